"""SGLang's Mamba / linear-attention state as kvxfer's recurrent-state groups (`kvxfer.state`),
read from what SGLang hands a transfer backend (`KVArgs.state_*`) and the model's own cache
parameters, and checked, never assumed.

What SGLang 0.5.23 keeps (`MambaPool`; docs/sglang.md, "Mamba and linear attention"): per
mamba layer a conv state `[size + 1, conv_dim / tp, K - 1]` and a temporal (SSM) state
`[size + 1, heads / tp, head_dim, N]`, each stacked over the layers; a request holds one slot
(its state index), slot 0 is SGLang's dummy. `KVArgs` lists one buffer per (state, layer):
every layer's conv, then every layer's temporal, each `size + 1` items of `item_len` bytes
(one slot), with `state_dim_per_tensor` the rank's rows (conv channels, heads).

How the rows split over TP is the model's sharding, which the pool's shapes alone do not say:
a gated delta net (Qwen3-Next) holds the r-th even slice of each of its conv's q, k and v
(SGLang's `conv_shard_groups`), a Mamba2 mixer (NemotronH, Falcon-H1, Granite) the r-th slice
of x and its share of B's and C's groups (`n_groups` rows of `N` channels each: with one group
and several ranks, each holds B and C whole), a Mamba1 mixer its slice of x; the temporal state
is heads, split evenly. Kimi's KDA keeps its conv channels last, `[K - 1, channels]` a slot
(SGLang's `state_slice_outer_counts` the `K - 1` rows): a run of its q, k and v per window row.
Each run is a `StateComponent`, in a `StateLayout` per tensor (conv and temporal are apart in
memory), so kvxfer moves a slot between any two TP sizes bit for bit. A prefill pipeline stage
holds a run of the model's state layers (`state_layer_ids` among `mamba2_cache_params.layers`),
its layouts' stage. (SGLang's own backends slice one contiguous range where no
`conv_shard_groups` are given, and need one TP size to divide the other.)

Refused, naming the setting: a Mamba2 model of several groups fewer than its ranks (SGLang's
own mixer refuses it too), a state without a conv (lightning attention) or without a temporal
state (LFM2's short convolutions), another state shape, a state registered whole on every
rank (`state_dim_per_tensor` 0), and SGLang's CPU pools on an AMX machine (their conv layout
is transposed in place, behind the same metadata).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvxfer.connector.groups import CacheGroup
from kvxfer.integrations.sglang.pools import tensor_at
from kvxfer.state import StateComponent, StateLayout, rows_held

if TYPE_CHECKING:
    from sglang.srt.disaggregation.base.conn import KVArgs

MAMBA = "mamba"  # SGLang's StateType.MAMBA


@dataclass(frozen=True)
class ConvPart:
    """One run of the conv state's channels, as the model shards it.

    Attributes:
        rows: the run's rows in the whole model, split evenly over the ranks (or replicated
            where fewer than the ranks: `kvxfer.state`).
        channels: channels a row (a Mamba2 group's B or C: `N`; else 1).
        segments: the rows of each sub-projection in the run, each split evenly (a gated delta
            net's q, k, v); empty: one.
    """

    rows: int
    channels: int = 1
    segments: tuple[int, ...] = ()

    def held(self, tp_size: int) -> int:
        """Channels of this run one rank holds."""
        rows = self.segments or (self.rows,)
        return sum(rows_held(size, tp_size) for size in rows) * self.channels


@dataclass(frozen=True)
class MambaModel:
    """The whole model's state rows, from its cache parameters.

    Attributes:
        conv: the conv state's channel runs, in a rank's order.
        heads: the temporal state's rows.
        channels_last: the conv keeps its channels last, `[K - 1, channels]` a slot (Kimi's
            KDA): `conv` then has a run per window row.
        layers: the model's recurrent layers, global ids in order (a pipeline stage holds a
            run of them).
    """

    conv: tuple[ConvPart, ...]
    heads: int
    channels_last: bool = False
    layers: tuple[int, ...] = ()

    @property
    def conv_outer_count(self) -> int:
        """Rows of a conv slot before the axis SGLang slices (`state_slice_outer_counts`):
        a channels-last conv's window rows, else 1."""
        return len(self.conv) if self.channels_last else 1


def mamba_model(model_config: Any, tp_size: int) -> MambaModel:
    """The served model's state rows, from SGLang's own cache parameters of its `ModelConfig`
    (`mambaish_config(...).mamba2_cache_params`, as its scheduler sizes the pool).

    Raises:
        ValueError: a state shape kvxfer has not verified (module docstring).
    """
    from sglang.srt.configs.hybrid_arch import mambaish_config

    config = mambaish_config(model_config)
    params = getattr(config, "mamba2_cache_params", None)
    shape = getattr(params, "shape", None)
    layers = tuple(int(i) for i in getattr(params, "layers", ()))
    if shape is not None and getattr(shape, "conv_slice_axis", 0) == 1:  # KDA: `[K - 1, ch]`
        return MambaModel(kda_conv_parts(shape), int(shape.num_heads), True, layers)
    if shape is None or not hasattr(shape, "intermediate_size"):
        raise ValueError(
            f"this model's linear-attention state ({type(shape).__name__}) is not a layout "
            "kvxfer's SGLang backend has verified (it moves gated delta nets, Mamba1 and "
            "Mamba2 mixers and KDA); serve it with another transfer backend"
        )
    # The attribute SGLang's configs size the pool from: NemotronH's `n_groups` (its
    # `mamba_n_groups` is a constructor default), Falcon-H1's and Granite's `mamba_n_groups`.
    groups = getattr(config, "n_groups", None) or getattr(config, "mamba_n_groups", None)
    return MambaModel(conv_parts(shape, groups, tp_size), int(shape.num_heads), False, layers)


def kda_conv_parts(shape: Any) -> tuple[ConvPart, ...]:
    """The conv's channel runs of SGLang's `KimiLinearStateShape`: channels last, so a run per
    window row (`K - 1`), each its q, k and v channels (`conv_shard_groups`), sliced apart.

    Raises:
        ValueError: more than one conv tensor, or no sub-blocks named.
    """
    if len(shape.conv) != 1 or not shape.conv_shard_groups:
        raise ValueError(
            f"a KDA state of {len(shape.conv)} conv tensors and sub-blocks "
            f"{shape.conv_shard_groups}: not a layout kvxfer's SGLang backend has verified"
        )
    return (_sub_blocks(shape),) * (int(shape.conv_kernel) - 1)


def _sub_blocks(shape: Any) -> ConvPart:
    """The run of the sub-blocks SGLang names (`conv_shard_groups`: q, k, v), each sliced
    apart over the ranks."""
    segments = tuple(int(g) for g in shape.conv_shard_groups)
    return ConvPart(sum(segments), 1, segments)


def conv_parts(shape: Any, n_groups: int | None, tp_size: int) -> tuple[ConvPart, ...]:
    """The conv's channel runs of SGLang's `Mamba2StateShape` (made at this rank's TP,
    `tp_size`) and the model's `n_groups` (None where its config has none): a gated delta
    net's q, k, v; a Mamba2 mixer's x, then B and C of `n_groups` rows of `N` channels (each
    rank holds its groups, or both whole where the model has one group and several ranks:
    SGLang's extension of `n_groups` to the TP); a Mamba1 mixer's x.

    Raises:
        ValueError: a layout kvxfer has not verified: more than one conv tensor, runs that do
            not add up to the rank's conv, or a Mamba2 model without `n_groups`.
    """
    if len(shape.conv) != 1:
        raise ValueError(
            f"this model keeps {len(shape.conv)} conv states a layer; kvxfer's SGLang backend "
            "moves one"
        )
    if int(shape.conv_kernel) <= 1 or int(shape.conv_dim) <= 0:
        raise ValueError(
            "a linear-attention state without a conv (lightning attention's): not a layout "
            "kvxfer's SGLang backend has verified; serve it with another transfer backend"
        )
    inner, local = int(shape.intermediate_size), int(shape.conv[0][0])
    if shape.conv_shard_groups:  # a gated delta net's q, k, v
        parts: tuple[ConvPart, ...] = (_sub_blocks(shape),)
    elif int(shape.conv_dim) == inner:  # Mamba1: the conv is x alone
        parts = (ConvPart(inner),)
    elif n_groups is None or (n_groups < tp_size and n_groups != 1):
        raise ValueError(
            f"a Mamba2 model with n_groups={n_groups} at TP {tp_size}: its groups' place on the "
            "ranks is not one kvxfer has verified (its config's n_groups or mamba_n_groups, "
            "1 or a multiple of the TP); serve it with another transfer backend"
        )
    else:
        state = int(shape.state_size)
        parts = (ConvPart(inner), ConvPart(n_groups, state), ConvPart(n_groups, state))
    held = sum(part.held(tp_size) for part in parts)
    if held != local:
        raise ValueError(
            f"the conv's runs {[(p.rows, p.channels) for p in parts]} give a rank {held} of its "
            f"{local} channels at TP {tp_size} (heads padded for this TP?); serve it with a TP "
            "that divides its heads"
        )
    return parts


def mamba_groups(
    kv_args: KVArgs,
    index: int,
    model: MambaModel,
    *,
    tp_size: int,
    tp_rank: int,
    pp_size: int = 1,
    pp_rank: int = 0,
    device: torch.device | str,
) -> list[CacheGroup]:
    """One rank's Mamba state, SGLang's state `index` of `kv_args`, as state groups: the conv's
    sub-projections, then the temporal state (module docstring). On a pipeline stage
    (`pp_size` > 1) its layers are the run of the model's recurrent layers SGLang's
    `state_layer_ids` name.

    Raises:
        ValueError: buffers that do not fit `model` at this TP, or a layout kvxfer has not
            verified (module docstring), naming what differs.
    """
    device = torch.device(device)
    _check_amx(device)
    ptrs, lens = kv_args.state_data_ptrs[index], kv_args.state_data_lens[index]
    items, rows = kv_args.state_item_lens[index], kv_args.state_dim_per_tensor[index]
    outer = list(kv_args.state_slice_outer_counts[index] or [])
    count = len(ptrs)
    if count % 2 or not (len(lens) == len(items) == len(rows) == count):
        raise ValueError(
            f"KVArgs: {count} Mamba state buffers, {len(lens)} lens, {len(items)} item lens, "
            f"{len(rows)} dims; expected a conv and a temporal buffer of every layer"
        )
    layers = count // 2
    layer_ids = list(kv_args.state_layer_ids[index] or [])
    if layer_ids and layer_ids[:layers] != layer_ids[layers:]:
        raise ValueError(
            f"KVArgs: Mamba state buffers of layers {layer_ids}, not a conv and a temporal "
            "buffer of every layer (a conv-only state, as LFM2's short convolutions keep, is "
            "not a layout kvxfer's SGLang backend has verified); serve it with another "
            "transfer backend"
        )
    if outer and outer != [model.conv_outer_count] * layers + [1] * layers:
        raise ValueError(
            f"the state's rows before its sliced axis (state_slice_outer_counts "
            f"{sorted(set(outer))}) are not the model's ({model.conv_outer_count} a conv, 1 a "
            "temporal state): not a layout kvxfer's SGLang backend has verified"
        )
    stage = _stage(model, layer_ids[:layers], pp_size, pp_rank)
    groups: list[CacheGroup] = []
    for name, entries, parts, outer_rows in (
        ("conv", slice(0, layers), model.conv, model.conv_outer_count),
        ("temporal", slice(layers, count), (ConvPart(model.heads),), 1),
    ):
        local = sum(part.held(tp_size) for part in parts)
        page = _one_size(name, items[entries], rows[entries], local // outer_rows)
        row = page // local  # bytes of one channel (a window row's, if channels last) or head
        components = tuple(
            StateComponent(part.rows, (part.channels * row,), torch.uint8, part.segments)
            for part in parts
        )
        layout = StateLayout(components, page, tp_size, tp_rank, *stage)
        pages = [
            _slots(name, ptr, nbytes, page, device)
            for ptr, nbytes in zip(ptrs[entries], lens[entries], strict=True)
        ]
        groups += layout.groups(pages)
    return groups


def _stage(
    model: MambaModel, stage_layers: list[int], pp_size: int, pp_rank: int
) -> tuple[int, int, int, int]:
    """A pipeline stage's place among the model's recurrent layers, as `StateLayout` takes it:
    `(pp_size, pp_rank, layer_start, total_layers)`; no place without pipeline parallelism.

    Raises:
        ValueError: the stage's layers are not a run of the model's recurrent layers.
    """
    if pp_size == 1:
        return 1, 0, 0, 0
    ids = list(model.layers)
    start = ids.index(stage_layers[0]) if stage_layers and stage_layers[0] in ids else -1
    if start < 0 or ids[start : start + len(stage_layers)] != stage_layers:
        raise ValueError(
            f"pipeline stage {pp_rank}: its Mamba layers {stage_layers} (state_layer_ids) are "
            f"not a run of the model's {ids}; not a layout kvxfer's SGLang backend has verified"
        )
    return pp_size, pp_rank, start, len(ids)


def _one_size(name: str, items: Sequence[int], rows: Sequence[int], local: int) -> int:
    """A state's one slot size over every layer, checked against the `local` rows (channels,
    heads) the model gives a rank."""
    if 0 in rows:
        raise ValueError(
            f"the {name} state is registered whole on every rank (state_dim_per_tensor 0): not "
            "a layout kvxfer's SGLang backend has verified"
        )
    if set(rows) != {local} or len(set(items)) != 1 or items[0] % local:
        raise ValueError(
            f"the {name} state: {sorted(set(rows))} rows of {sorted(set(items))} bytes a slot "
            f"per layer, expected {local} rows (the model's at this TP) of one size; the pool "
            "is not a layout kvxfer has verified"
        )
    return items[0]


def _slots(name: str, ptr: int, nbytes: int, slot_bytes: int, device: torch.device) -> torch.Tensor:
    """A layer's state buffer as `[slots, slot_bytes]` bytes."""
    if nbytes % slot_bytes:
        raise ValueError(
            f"the {name} state: a buffer of {nbytes} bytes is not whole slots of {slot_bytes}"
        )
    return tensor_at(ptr, nbytes, torch.uint8, device).view(nbytes // slot_bytes, slot_bytes)


def _check_amx(device: torch.device) -> None:
    """Refuse SGLang's CPU pools on an AMX machine: its conv state is then re-strided to
    `[K - 1, channels]` in place (`_init_amx_conv_state`), behind the same metadata."""
    if device.type != "cpu":
        return
    from sglang.srt.utils import cpu_has_amx_support

    if cpu_has_amx_support():
        raise ValueError(
            "SGLang's Mamba state on an AMX CPU keeps its conv state transposed, a layout "
            "kvxfer's SGLang backend has not verified; serve it on CUDA or without AMX"
        )
