"""`KVCacheSpec`: the geometry of one rank's paged KV cache, and the handshake's payload.

The layout contract (docs/design.md) fixes the per-layer tensor shape for every combination of
`layout`, `kv_placement` and `mla`; `kvxfer.layout` is its single source of truth, and
`KVCacheSpec.layer_shape` reads it from there.

Pipeline parallelism: a rank of pipeline stage `pp_rank` holds the contiguous global layers
`[layer_start, layer_start + num_layers)` of a model with `total_layers` layers, and its cache
tensors are those layers in order (local index = global index - `layer_start`). The range is
explicit, never computed: vLLM splits layers unevenly (`vllm.distributed.utils.get_pp_indices`,
or `VLLM_PP_LAYER_PARTITION`). `pp_layer_ranges` gives vLLM's default split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NoReturn

import msgspec
import numpy as np
import torch

from kvxfer.layout import (
    ALL_KV_PLACEMENTS,
    AMX_GROUP,
    AMX_TILES,
    CPU_PLACEMENTS,
    LAYOUTS,
    KVPlacement,
    Layout,
)

# The dtypes and fp8 roundings a spec names: the layout contract's, re-exported here.
from kvxfer.layout import DTYPE_ITEMSIZE as DTYPE_ITEMSIZE
from kvxfer.layout import FP8_DTYPES as FP8_DTYPES
from kvxfer.layout import FP8_ROUNDINGS as FP8_ROUNDINGS
from kvxfer.layout import KV_PLACEMENTS as KV_PLACEMENTS  # re-exported: the GPU placements
from kvxfer.layout import TORCH_DTYPES as TORCH_DTYPES
from kvxfer.layout import DType as DType
from kvxfer.layout import FP8Rounding as FP8Rounding
from kvxfer.layout import layer_shape as _layer_shape

INT_FIELDS: tuple[str, ...] = (
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "tp_size",
    "tp_rank",
    "block_size",
    "num_blocks",
    "pp_size",
    "pp_rank",
    "layer_start",
    "total_layers",
    "block_stride",
)


def _fail(field: str, problem: str, fix: str) -> NoReturn:
    raise ValueError(f"KVCacheSpec.{field}: {problem}; {fix}")


def _as_int(field: str, value: object) -> int:
    """`value` as a plain int: Python and numpy integers pass, bools and all else are refused."""
    if isinstance(value, (bool, np.bool_)):
        _fail(
            field,
            f"must be an integer, got the bool {value!r}",
            "pass an int such as 1 (numpy integers are accepted too), not True/False",
        )
    if isinstance(value, (int, np.integer)):
        return int(value)
    _fail(
        field,
        f"must be an integer, got {value!r} of type {type(value).__name__}",
        "pass an int (numpy integers are accepted too)",
    )


def _normalize(spec: KVCacheSpec, field: str, value: object) -> None:
    """Store a plain `int`/`bool` in place of a numpy scalar, so specs encode and compare alike."""
    given = getattr(spec, field)
    if type(given) is type(value):
        return
    force_setattr = getattr(msgspec.structs, "force_setattr", None)
    if force_setattr is None:  # msgspec < 0.18.5 cannot set a field of a frozen struct
        _fail(
            field,
            f"got a {type(given).__name__}, which this msgspec version cannot convert",
            f"pass {field}=int(...) or install msgspec>=0.18.5",
        )
    force_setattr(spec, field, value)


class KVCacheSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's KV cache geometry: what the rank holds and how it lays it out in memory.

    Attributes:
        num_layers: attention layers, one cache tensor each.
        num_kv_heads: KV heads of the whole model (`H`), not of this rank. 1 when `mla`.
        head_dim: elements per head (the MLA latent width when `mla`).
        dtype: "float16", "bfloat16", "float32", or an fp8 cache: "float8_e4m3fn" or
            "float8_e5m2" (moved bit for bit like the others).
        tp_size: tensor-parallel size of this engine (`T`).
        tp_rank: this rank, in `[0, tp_size)`.
        block_size: tokens per block (page).
        num_blocks: blocks per layer tensor.
        layout: "NHD" (tokens, heads) or "HND" (heads, tokens) inside a block.
        kv_placement: "kv_first" (`[2, blocks, ...]`), "blocks_first" (`[blocks, 2, ...]`),
            "kv_inner" (K then V in each head's row: `[blocks, ..., 2 * head_dim]`, vLLM 0.33),
            "k_transposed" (vLLM CPU attention, HND only: `[blocks, heads, block_size,
            2 * head_dim]` holding, per (block, head), K as `[head_dim, block_size]` then V as
            `[block_size, head_dim]`; moved by the torch backend, `kvxfer.layout`) or
            "amx_tiles" (vLLM CPU attention on AMX: the same shape, K and V packed in tile
            groups of 16, `kvxfer.layout`; blocks and head_dim multiples of 16).
        mla: one latent plane `[num_blocks, block_size, head_dim]`, the same on every rank;
            `layout` and `kv_placement` are then ignored.
        pp_size: pipeline-parallel size of this engine (1: no pipeline parallelism).
        pp_rank: this rank's pipeline stage, in `[0, pp_size)`.
        layer_start: global index of this rank's first layer: the rank holds global layers
            `[layer_start, layer_start + num_layers)`, and `num_layers` counts only those.
            0 without pipeline parallelism.
        total_layers: the model's layers over every stage. Required with `pp_size > 1`; 0 (the
            default) without pipeline parallelism, where it reads as `num_layers`
            (`model_layers`).
        block_stride: elements from one block to the next in a layer tensor; 0 (the default):
            the dense layout of the contract. Larger: each layer tensor is a view whose blocks
            sit `block_stride` elements apart, the rest of each stride holding other data
            (vLLM's Mamba state pages: one sub-projection of a page that holds several). Only
            where blocks are the outermost axis (`blocks_first`, `kv_inner`, MLA).
        k_scales: an fp8 cache's K scale per layer of this rank, as vLLM keeps them
            (`layer._k_scale`: stored values are `K / k_scale`); empty (the default) reads as
            1.0 for every layer. Only fp8 caches have scales.
        v_scales: the same for V (empty for MLA, whose latent plane uses `k_scales`).
        fp8_rounding: how the engine's own cache write quantizes into this fp8 cache, so that a
            converting transfer writes the same bytes: "nearest_even" (vLLM's CUDA write:
            `x / scale` in float32, saturated to the format's largest finite value, rounded to
            nearest even), "toward_zero" (vLLM CPU attention's `cpu_attn_reshape_and_cache`:
            `x * (1 / scale)` in float32, saturated, the mantissa truncated toward zero, -0 as
            +0, NaN as the largest finite value) or "torch_cast" (SGLang's `set_kv_buffer` on
            CUDA: `x / scale` with the scale and the quotient rounded to the source's dtype,
            then torch's cast: nearest even, e4m3fn saturated, e5m2 not). Only fp8 caches
            round; a cache with "toward_zero" converts on its own side, with the torch backend.

    Head ownership (docs/design.md): with `H >= T`, `T` divides `H` and rank `r` holds heads
    `[r*H/T, (r+1)*H/T)`; with `H < T`, `H` divides `T` and rank `r` holds head `r // (T/H)`.
    Every pipeline stage shards its layers' heads the same way over its `tp_size` ranks.

    The ranks of an engine are numbered pp-major, as vLLM numbers them inside a data-parallel
    group: `engine_rank = pp_rank * tp_size + tp_rank`, in `[0, engine_size)`. Without
    pipeline parallelism the engine rank is the TP rank.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: DType
    tp_size: int
    tp_rank: int
    block_size: int
    num_blocks: int
    layout: Layout = "NHD"
    kv_placement: KVPlacement = "kv_first"
    mla: bool = False
    pp_size: int = 1
    pp_rank: int = 0
    layer_start: int = 0
    total_layers: int = 0
    block_stride: int = 0
    k_scales: tuple[float, ...] = ()
    v_scales: tuple[float, ...] = ()
    fp8_rounding: FP8Rounding = "nearest_even"

    def __post_init__(self) -> None:
        for name in INT_FIELDS:
            value = getattr(self, name)
            if type(value) is not int:  # numpy integers become ints; bools and others fail
                _normalize(self, name, _as_int(name, value))
        if isinstance(self.mla, np.bool_):
            _normalize(self, "mla", bool(self.mla))
        for name in ("num_layers", "num_kv_heads", "head_dim", "tp_size", "block_size"):
            value = getattr(self, name)
            if value <= 0:
                _fail(name, f"must be a positive integer, got {value!r}", "pass a value >= 1")
        if self.num_blocks <= 0:
            _fail("num_blocks", f"must be positive, got {self.num_blocks}", "pass >= 1")
        if not 0 <= self.tp_rank < self.tp_size:
            _fail(
                "tp_rank",
                f"{self.tp_rank!r} is out of range for tp_size {self.tp_size}",
                f"pass a rank in [0, {self.tp_size})",
            )
        if self.dtype not in TORCH_DTYPES:
            _fail("dtype", f"unknown dtype {self.dtype!r}", f"use one of {sorted(TORCH_DTYPES)}")
        if self.layout not in LAYOUTS:
            _fail("layout", f"unknown layout {self.layout!r}", f"use one of {list(LAYOUTS)}")
        if self.kv_placement not in ALL_KV_PLACEMENTS:
            _fail(
                "kv_placement",
                f"unknown placement {self.kv_placement!r}",
                f"use one of {list(ALL_KV_PLACEMENTS)}",
            )
        if self.kv_placement in CPU_PLACEMENTS and self.layout != "HND" and not self.mla:
            _fail(
                "layout",
                f"kv_placement {self.kv_placement!r} (vLLM CPU attention) keeps heads outside "
                f"slots, got layout {self.layout!r}",
                "pass layout='HND'",
            )
        if self.kv_placement == AMX_TILES and not self.mla:
            for name in ("block_size", "head_dim"):
                if getattr(self, name) % AMX_GROUP:
                    _fail(
                        name,
                        f"kv_placement 'amx_tiles' (vLLM CPU attention's AMX layout) packs "
                        f"slots and dims in groups of {AMX_GROUP}, got {getattr(self, name)}",
                        f"use a multiple of {AMX_GROUP} (vLLM's amx ISA needs blocks of 32s)",
                    )
        if not isinstance(self.mla, bool):
            _fail("mla", f"must be a bool, got {self.mla!r}", "pass True or False")
        if self.mla and self.num_kv_heads != 1:
            _fail(
                "num_kv_heads",
                f"an MLA cache has one latent head, got {self.num_kv_heads}",
                "pass num_kv_heads=1 with mla=True",
            )
        if self.pp_size != 1 or self.pp_rank or self.layer_start or self.total_layers:
            self._check_pipeline()
        if self.block_stride:
            self._check_block_stride()
        if self.k_scales or self.v_scales:
            self._check_scales()
        if self.fp8_rounding != "nearest_even":
            self._check_fp8_rounding()
        heads, tp = self.num_kv_heads, self.tp_size
        if heads >= tp and heads % tp != 0:
            _fail(
                "num_kv_heads",
                f"{heads} KV heads cannot be split evenly over tp_size {tp}",
                "use a tp_size that divides num_kv_heads",
            )
        if heads < tp and tp % heads != 0:
            _fail(
                "num_kv_heads",
                f"{heads} KV heads cannot be replicated evenly over tp_size {tp}",
                "use a tp_size that is a multiple of num_kv_heads",
            )

    def _check_fp8_rounding(self) -> None:
        if self.fp8_rounding not in FP8_ROUNDINGS:
            _fail(
                "fp8_rounding",
                f"unknown rounding {self.fp8_rounding!r}",
                f"use one of {list(FP8_ROUNDINGS)}",
            )
        if self.dtype not in FP8_DTYPES:
            _fail(
                "fp8_rounding",
                f"{self.fp8_rounding!r} describes an fp8 cache's write, but dtype is "
                f"{self.dtype!r}",
                "leave fp8_rounding at 'nearest_even' for other dtypes",
            )

    def _check_scales(self) -> None:
        if self.dtype not in FP8_DTYPES:
            _fail(
                "k_scales",
                f"scales describe an fp8 cache, but dtype is {self.dtype!r}",
                "pass k_scales and v_scales only with an fp8 dtype",
            )
        if self.mla and self.v_scales:
            _fail("v_scales", "an MLA cache has one latent plane", "pass its scales as k_scales")
        for name in ("k_scales", "v_scales"):
            scales = getattr(self, name)
            if not isinstance(scales, tuple) or not all(type(x) is float for x in scales):
                try:
                    scales = tuple(float(x) for x in scales)
                except (TypeError, ValueError):
                    _fail(name, f"must be a sequence of floats, got {scales!r}", "pass floats")
                _normalize(self, name, scales)  # a tuple of floats: specs hash and compare alike
            if scales and len(scales) != self.num_layers:
                _fail(
                    name,
                    f"{len(scales)} scales for {self.num_layers} layers",
                    "pass one scale per layer of this rank (or none: 1.0 for every layer)",
                )
            bad = [x for x in scales if not (math.isfinite(x) and x > 0)]
            if bad:
                _fail(name, f"{bad[0]!r} is not a positive finite scale", "pass scales > 0")

    def layer_scales(self, first: int, count: int) -> np.ndarray:
        """float32 `[count, planes]`: (K, V) scales of local layers `[first, first + count)`
        (MLA: K only), 1.0 where none were given."""
        planes = 1 if self.mla else 2
        out = np.ones((count, planes), dtype=np.float32)
        for plane, scales in enumerate((self.k_scales, self.v_scales)[:planes]):
            if scales:
                out[:, plane] = scales[first : first + count]
        return out

    def _check_block_stride(self) -> None:
        if self.block_stride < 0:
            _fail("block_stride", f"must be >= 0, got {self.block_stride}", "pass 0 or more")
        if not (self.mla or self.kv_placement in ("blocks_first", "kv_inner")):
            _fail(
                "block_stride",
                f"needs blocks as the outermost axis, but kv_placement {self.kv_placement!r} "
                "puts K and V planes outside the blocks",
                "use blocks_first or kv_inner, or block_stride=0",
            )
        if self.block_stride < self.block_elements:
            _fail(
                "block_stride",
                f"{self.block_stride} elements is less than one block's "
                f"{self.block_elements}, so blocks would overlap",
                f"pass at least {self.block_elements}, or 0 for the dense layout",
            )

    def _check_pipeline(self) -> None:
        """The pipeline fields (skipped for the defaults: a spec without pipeline parallelism
        validates as fast as before they existed)."""
        if self.pp_size <= 0:
            _fail("pp_size", f"must be a positive integer, got {self.pp_size}", "pass >= 1")
        if not 0 <= self.pp_rank < self.pp_size:
            _fail(
                "pp_rank",
                f"{self.pp_rank!r} is out of range for pp_size {self.pp_size}",
                f"pass a stage in [0, {self.pp_size})",
            )
        if self.layer_start < 0:
            _fail("layer_start", f"must be >= 0, got {self.layer_start}", "pass the first layer")
        if self.total_layers < 0:
            _fail(
                "total_layers",
                f"must be >= 0, got {self.total_layers}",
                "pass the model's layer count (or 0 without pipeline parallelism)",
            )
        end = self.layer_start + self.num_layers
        if self.pp_size == 1:
            if self.layer_start:
                _fail(
                    "layer_start",
                    f"is {self.layer_start} with pp_size 1, where one rank holds every layer",
                    "pass layer_start=0, or the engine's pp_size",
                )
            if self.total_layers not in (0, self.num_layers):
                _fail(
                    "total_layers",
                    f"is {self.total_layers} with pp_size 1, where the rank holds all "
                    f"{self.num_layers} layers (num_layers)",
                    "pass total_layers=0 (or equal to num_layers), or the engine's pp_size",
                )
            return
        if self.total_layers == 0:
            _fail(
                "total_layers",
                f"is required with pp_size {self.pp_size}",
                "pass the model's layer count over every pipeline stage",
            )
        if end > self.total_layers:
            _fail(
                "num_layers",
                f"layers [{self.layer_start}, {end}) run past total_layers {self.total_layers}",
                "pass this stage's own layer count and first layer (layer_start)",
            )
        if self.pp_rank == 0 and self.layer_start != 0:
            _fail(
                "layer_start",
                f"is {self.layer_start} on pipeline stage 0, which holds the first layers",
                "pass layer_start=0 for pp_rank 0",
            )
        if self.pp_rank == self.pp_size - 1 and end != self.total_layers:
            _fail(
                "num_layers",
                f"the last pipeline stage ends at layer {end}, not at total_layers "
                f"{self.total_layers}",
                "the last stage holds the model's last layers: check num_layers and layer_start",
            )

    @property
    def model_layers(self) -> int:
        """The model's layers over every pipeline stage (`total_layers`, or `num_layers`
        without pipeline parallelism)."""
        return self.total_layers or self.num_layers

    @property
    def layers(self) -> range:
        """The global layers this rank holds, in the order of its cache tensors."""
        return range(self.layer_start, self.layer_start + self.num_layers)

    @property
    def engine_rank(self) -> int:
        """This rank among every rank of its engine, pp-major: `pp_rank * tp_size + tp_rank`
        (the TP rank without pipeline parallelism)."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def engine_size(self) -> int:
        """Ranks in this engine: `pp_size * tp_size`."""
        return self.pp_size * self.tp_size

    @property
    def rank_name(self) -> str:
        """How messages name this rank: "rank 3", or "rank 3 (pp 1, tp 1)" with pipeline
        parallelism."""
        if self.pp_size == 1:
            return f"rank {self.tp_rank}"
        return f"rank {self.engine_rank} (pp {self.pp_rank}, tp {self.tp_rank})"

    @property
    def heads_per_rank(self) -> int:
        """KV heads held by one rank (`h`)."""
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def first_head(self) -> int:
        """Global index of this rank's first KV head."""
        if self.num_kv_heads >= self.tp_size:
            return self.tp_rank * self.heads_per_rank
        return self.tp_rank // (self.tp_size // self.num_kv_heads)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of the cache tensors."""
        return TORCH_DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """The per-layer tensor shape of the layout contract (`kvxfer.layout`)."""
        return _layer_shape(
            self.num_blocks,
            self.block_size,
            self.heads_per_rank,
            self.head_dim,
            self.layout,
            self.kv_placement,
            self.mla,
        )

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer tensor's elements (with `block_stride`, not counting the gaps
        between blocks: see `layer_extent_bytes`)."""
        n = self.itemsize
        for dim in self.layer_shape:
            n *= dim
        return n

    @property
    def block_elements(self) -> int:
        """Elements of one block of one layer."""
        n = 1
        for dim in self.layer_shape:
            n *= dim
        return n // self.num_blocks

    @property
    def layer_extent_bytes(self) -> int:
        """Bytes from a layer tensor's first element to the end of its last one: what a
        transport registers (`layer_bytes` without `block_stride`)."""
        if not self.block_stride:
            return self.layer_bytes
        return ((self.num_blocks - 1) * self.block_stride + self.block_elements) * self.itemsize

    @property
    def layer_strides(self) -> tuple[int, ...]:
        """Element strides of a layer tensor: dense, or with `block_stride` on the outermost
        (block) axis."""
        strides, step = [], 1
        for dim in reversed(self.layer_shape):
            strides.append(step)
            step *= dim
        strides.reverse()
        if self.block_stride:
            strides[0] = self.block_stride
        return tuple(strides)

    def with_rank(self, tp_rank: int) -> KVCacheSpec:
        """The same geometry as seen by another TP rank of the same pipeline stage."""
        return msgspec.structs.replace(self, tp_rank=tp_rank)

    def engine_ranks(
        self, layer_ranges: Sequence[tuple[int, int] | range] | None = None
    ) -> list[KVCacheSpec]:
        """The specs of every rank of this engine, by `engine_rank` (pp-major: stage 0's TP
        ranks first), which is what `plan_pairs` and `reshard` take.

        Without pipeline parallelism these are the `tp_size` TP ranks, as they always were.

        Args:
            layer_ranges: with `pp_size > 1`, each stage's global layers, `(start, stop)` or a
                range, in stage order. Default: vLLM's default split (`pp_layer_ranges`), which
                must then agree with this rank's own range.

        Raises:
            ValueError: `layer_ranges` do not tile `[0, total_layers)` in `pp_size` stages, or
                disagree with this rank's own layers.
        """
        if self.pp_size == 1 and layer_ranges is None:
            return [self.with_rank(rank) for rank in range(self.tp_size)]
        given = layer_ranges is not None
        if layer_ranges is None:
            ranges = pp_layer_ranges(self.model_layers, self.pp_size)
        else:
            ranges = [range(r[0], r[1]) if isinstance(r, tuple) else r for r in layer_ranges]
        where = "layer_ranges" if given else "layer_ranges (vLLM's default split)"
        if len(ranges) != self.pp_size or any(
            r.start != (ranges[i - 1].stop if i else 0) or len(r) < 1 for i, r in enumerate(ranges)
        ):
            raise ValueError(
                f"{where}: {[(r.start, r.stop) for r in ranges]} must be {self.pp_size} "
                f"non-empty consecutive (start, stop) ranges from layer 0; pass each stage's "
                "layers"
            )
        if ranges[-1].stop != self.model_layers or ranges[self.pp_rank] != self.layers:
            raise ValueError(
                f"{where}: {[(r.start, r.stop) for r in ranges]} disagree with this rank's "
                f"layers [{self.layer_start}, {self.layer_start + self.num_layers}) of "
                f"{self.model_layers} (stage {self.pp_rank}); pass every stage's actual range"
            )
        return [
            msgspec.structs.replace(
                self,
                pp_rank=stage,
                tp_rank=rank,
                layer_start=layers.start,
                num_layers=len(layers),
            )
            for stage, layers in enumerate(ranges)
            for rank in range(self.tp_size)
        ]


def pp_layer_ranges(total_layers: int, pp_size: int) -> list[range]:
    """vLLM's default split of `total_layers` layers over `pp_size` pipeline stages
    (`vllm.distributed.utils.get_pp_indices` without `VLLM_PP_LAYER_PARTITION`):
    `total_layers // pp_size` each, and the remainder one each to the stages before the last,
    from the second-to-last backwards (the last stage also runs the LM head).

    Raises:
        ValueError: fewer layers than stages, or a size below 1.
    """
    if pp_size < 1 or total_layers < pp_size:
        raise ValueError(
            f"pp_size: {total_layers} layers cannot be split over {pp_size} pipeline stages; "
            "every stage needs at least one layer"
        )
    sizes = [total_layers // pp_size] * pp_size
    for i in range(2, total_layers % pp_size + 2):
        sizes[-i] += 1
    starts = [sum(sizes[:stage]) for stage in range(pp_size)]
    return [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]


def encode_spec(spec: KVCacheSpec) -> bytes:
    """Serialize a spec with msgpack (the handshake's wire format)."""
    return msgspec.msgpack.encode(spec)


def decode_spec(data: bytes) -> KVCacheSpec:
    """Parse and validate a spec from msgpack; a bad field raises `msgspec.ValidationError`."""
    return msgspec.msgpack.decode(data, type=KVCacheSpec)


def allocate_kv_caches(spec: KVCacheSpec, device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """Allocate one uninitialized tensor per layer, shaped by the layout contract.

    Args:
        spec: the rank's geometry.
        device: where to allocate.

    Returns:
        `spec.num_layers` contiguous tensors of shape `spec.layer_shape` and dtype `spec.dtype`.
    """
    return [
        torch.empty(spec.layer_shape, dtype=spec.torch_dtype, device=device)
        for _ in range(spec.num_layers)
    ]
