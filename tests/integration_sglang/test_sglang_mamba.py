"""SGLang's Mamba / linear-attention state (its `MambaPool` beside the full-attention layers'
KV in a `HybridLinearKVPool`) through kvxfer's SGLang backend, between engines of other TP
sizes, bit for bit.

Each rank is a process as in test_sglang_transfer.py (`ranks.py`), its pool SGLang's own: the
state's shapes and dtypes are SGLang's at the rank's TP (`mamba2_cache_params`), and SGLang's
`setup_state_kv_args` registers it as one "mamba" state. The prefill writes its part of a
seeded whole-model state into the request's slot (every other slot holds other values), and
sends the slot with its last chunk; the decode poisons its pool and receives into another slot.
What a decode rank must hold is its part of that whole state by the model's own sharding rule
(`ranks.mamba_of_rank`: the r-th even slice of each conv sub-block, back to back, and the r-th
slice of the heads), independent of kvxfer and of SGLang's transfer helpers. Kimi-Linear's KDA
keeps its conv channels last (`[K - 1, channels]` a slot: the rank's q | k | v slices in every
window row) and its full-attention layers are MLA.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
import test_sglang_transfer
import torch
from ranks import (
    RankConfig,
    attn_tp,
    conv_channel_axis,
    draft_config,
    global_kv,
    global_mamba,
    heads_of,
    mamba_geometry,
    mamba_of_rank,
    run_rank,
)
from test_sglang_transfer import RANK_HANG_S, _rank_context, _run_pair

from kvxfer.addresses import free_port

KV_HEADS = 4  # the full-attention layers' (of 16 each): TP 4 still shards them
_COMMON = {
    "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 8,
    "num_key_value_heads": KV_HEADS, "head_dim": 16, "num_hidden_layers": 4, "vocab_size": 256,
    "max_position_embeddings": 1024, "torch_dtype": "bfloat16", "bos_token_id": 1,
    "eos_token_id": 2,
}  # fmt: skip
# Qwen3-Next (layers 0, 2 a gated delta net, 1, 3 full attention): conv [q | k | v] of
# 32 | 32 | 128 channels (sub-blocks of other sizes, so a split of the whole range shows),
# temporal 8 value heads of (16, 8).
GDN = {
    **_COMMON, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
    "full_attention_interval": 2, "linear_num_key_heads": 4, "linear_key_head_dim": 8,
    "linear_num_value_heads": 8, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1,
}  # fmt: skip
# NemotronH (layers 0, 2 Mamba2, 1, 3 attention): conv [x | B | C] of 128 | 32 | 32 channels,
# temporal 8 heads of (16, 8); n_groups 4, which TP 1, 2 and 4 divide.
MAMBA2 = {
    **_COMMON, "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
    "hybrid_override_pattern": "M*M*", "mamba_num_heads": 8, "mamba_head_dim": 16,
    "n_groups": 4, "ssm_state_size": 8, "conv_kernel": 4, "expand": 1,
}  # fmt: skip
# Kimi-Linear (layers 0, 2 KDA, `kda_layers` counted from 1; 1, 3 MLA attention, a latent of
# 8 + 8 rope: `ranks`' MLA pool): conv channels last, 3 window rows of [q | k | v] of 48
# channels each (SGLang's KDA takes its k heads and head dim from its q's, so the sub-blocks are
# alike: a split of the whole range still shows, as q | half of k at TP 2), temporal 4 heads
# of (12, 12); TP 1, 2 and 4 divide the heads.
KDA = {
    **_COMMON, "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
    "num_key_value_heads": 8, "pad_token_id": 0, "q_lora_rank": None, "kv_lora_rank": 8,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16, "num_experts": 4,
    "num_experts_per_token": 2, "moe_intermediate_size": 64, "num_shared_experts": 1,
    "first_k_dense_replace": 1,
    "linear_attn_config": {
        "kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 4, "head_dim": 12,
        "short_conv_kernel_size": 4,
    },
}  # fmt: skip


def _model_dir(factory: pytest.TempPathFactory, name: str, config: dict) -> str:
    path = factory.mktemp(name)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


bootstrap_port = test_sglang_transfer.bootstrap_port  # the fixture: the backend's server


@pytest.fixture(scope="module")
def gdn_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _model_dir(tmp_path_factory, "gdn", GDN)


@pytest.fixture(scope="module")
def mamba2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _model_dir(tmp_path_factory, "mamba2", MAMBA2)


@pytest.fixture(scope="module")
def mamba2_g1_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """n_groups 1: at TP 2 SGLang gives every rank all of B and C."""
    return _model_dir(tmp_path_factory, "mamba2-g1", {**MAMBA2, "n_groups": 1})


@pytest.fixture(scope="module")
def kda_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _model_dir(tmp_path_factory, "kda", KDA)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An EAGLE draft (a one-layer Llama) for the hybrid target."""
    llama = {**_COMMON, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    return _model_dir(tmp_path_factory, "draft", {**llama, "num_hidden_layers": 1})


def _mamba_fields(kind: str, slots: tuple[int, int], tps: tuple[int, int], **extra: Any) -> dict:
    """RankConfig fields of every rank of a hybrid pair (through `_run_pair`'s per-rank
    fields): the model kind, and each side's slot of the request."""
    return {
        (role, rank): {"mamba": kind, "mamba_slot": slot, **extra}
        for role, slot, tp in zip(("prefill", "decode"), slots, tps, strict=True)
        for rank in range(tp)
    }


@pytest.mark.parametrize(
    ("kind", "prefill", "decode", "slots", "as_sglang"),
    [
        ("gdn", (1, 16), (2, 32), (3, 5), False),
        ("gdn", (2, 32), (1, 16), (4, 4), True),
        ("gdn", (2, 16), (4, 16), (2, 6), False),
        ("mamba2", (1, 16), (2, 16), (1, 6), False),
        ("mamba2", (2, 64), (1, 16), (6, 2), False),
        ("mamba2_g1", (1, 16), (2, 32), (2, 3), False),
        ("mamba2_g1", (2, 16), (1, 16), (5, 1), False),
        ("kda", (1, 16), (2, 32), (4, 2), False),
        ("kda", (2, 16), (1, 16), (3, 6), True),
        ("kda", (2, 32), (4, 16), (5, 5), False),
        ("kda", (4, 16), (1, 64), (1, 3), False),
    ],
    ids=[
        "gdn-tp1-tp2-page16-page32",
        "gdn-tp2-tp1-page32-page16-decode-0d-slot",
        "gdn-tp2-tp4",
        "mamba2-tp1-tp2",
        "mamba2-tp2-tp1-page64-page16",
        "mamba2-one-group-tp1-tp2",
        "mamba2-one-group-tp2-tp1",
        "kda-tp1-tp2-page16-page32",
        "kda-tp2-tp1-decode-0d-slot",
        "kda-tp2-tp4-page32-page16",
        "kda-tp4-tp1-page16-page64",
    ],
)
def test_a_hybrid_models_state_moves_bit_exact_beside_its_kv(
    request, bootstrap_port, kind, prefill, decode, slots, as_sglang
):
    """Each decode rank's slot holds its part of the request's state (conv: its slice of every
    sub-block, q | k | v or x | B | C, back to back, B and C whole where the model has one
    group and the decode several ranks, in every window row where the conv keeps its channels
    last; temporal: its heads), bit for bit, read
    from the prefill's slot (not another: they hold other values), with the prefill and decode
    slots apart where `slots` differ; every other slot of the decode's state (slot 0, SGLang's
    dummy, too) keeps its poison; the full-attention layers' KV (KDA's: MLA, the whole latent
    on every rank) moves as ever. `as_sglang`: the
    decode's slot handed over as SGLang's `_mamba_payload` makes it (a 0-d array)."""
    model_dir = request.getfixturevalue(f"{kind}_dir")
    room = 7000 + 100 * prefill[0] + 10 * decode[0] + slots[0]
    fields = _mamba_fields(
        kind.removesuffix("_g1"), slots, (prefill[0], decode[0]), mamba_slot_0d=as_sglang
    )
    mla = kind == "kda"
    prefills, decodes, cfgs = _run_pair(
        model_dir, bootstrap_port, room, prefill, decode, mla=mla, faults=fields, kv_heads=KV_HEADS
    )
    geo = mamba_geometry(cfgs[0])
    want_kv = global_kv(cfgs[0]).view(torch.int16)[list(geo.full_layers)]
    if mla:  # every rank holds the whole latent
        helds = [torch.from_numpy(p["held"]) for p in prefills]
        assert all(torch.equal(h, helds[0]) for h in helds), "the prefill ranks' latents differ"
        held = helds[0]
    else:
        held = torch.cat([torch.from_numpy(p["held"]) for p in prefills], 3)
    assert torch.equal(held, want_kv), "the prefill pools hold other KV than SGLang was given"
    for result, cfg in zip(decodes, cfgs, strict=True):
        rank = f"decode rank {cfg.tp_rank} of TP {cfg.tp_size}"
        got = torch.from_numpy(result["held"])
        want = want_kv if mla else want_kv[:, :, :, heads_of(cfg)]
        assert torch.equal(got, want), f"{rank}: full-attention KV"
        assert result["untouched"], f"{rank} wrote KV outside the request's pages"
        assert result["aux"] == (1000 + room % 1000, room)
        _assert_state_moved(result, cfg)


def _assert_state_moved(result: dict, cfg: RankConfig) -> None:
    """The decode rank's Mamba slot holds its part of the request's state (`mamba_of_rank` of
    `global_mamba`), bit for bit, and every other slot its poison."""
    rank = f"decode rank {cfg.tp_rank} of TP {cfg.tp_size}"
    conv, temporal = global_mamba(cfg)
    want_conv, want_temporal = mamba_of_rank(cfg, conv, temporal)
    state = result["state"]
    got_conv = torch.from_numpy(state["conv"])
    assert got_conv.shape == want_conv.shape, f"{rank}: conv of {got_conv.shape}"
    differs = (got_conv != want_conv.view(torch.int16)).movedim(
        conv_channel_axis(mamba_geometry(cfg)), -1
    )
    assert not differs.any(), (
        f"{rank}: conv differs at channels {differs.flatten(0, -2).any(0).nonzero().flatten()}"
    )
    got_temporal = torch.from_numpy(state["temporal"])
    assert torch.equal(got_temporal, want_temporal.view(torch.int32)), (
        f"{rank}: temporal differs at heads "
        f"{(got_temporal != want_temporal.view(torch.int32)).flatten(2).any(-1).any(0)}"
    )
    assert state["untouched"], f"{rank} wrote another slot of its Mamba state"


@pytest.mark.parametrize(
    ("kind", "prefill", "decode", "kv_dtypes", "slots"),
    [
        ("gdn", (1, 16), (2, 32), ("auto", "fp8_e4m3"), (2, 5)),
        ("gdn", (2, 16), (1, 16), ("fp8_e4m3", "auto"), (6, 1)),
        ("kda", (1, 16), (2, 32), ("auto", "fp8_e4m3"), (3, 4)),
        ("kda", (2, 16), (1, 16), ("fp8_e4m3", "auto"), (5, 2)),
    ],
    ids=[
        "bf16-tp1-page16-e4m3-tp2-page32",
        "e4m3-tp2-bf16-tp1",
        "kda-bf16-tp1-e4m3-tp2",
        "kda-e4m3-tp2-bf16-tp1",
    ],
)
def test_a_hybrid_models_kv_changes_dtype_by_its_full_layers_scales(
    request, bootstrap_port, kind, prefill, decode, kv_dtypes, slots
):
    """A gated delta net's full-attention layers (1 and 3 of 4: SGLang's `HybridLinearKVPool`
    keeps them as its layers 0 and 1) between a bf16 and an fp8 engine: into fp8, the decode
    holds what SGLang's own fp8 write makes of the request's KV; out of fp8, the prefill's fp8
    KV times its scales; each layer by the scales of its model layer (`ranks.kv_scales`, other
    for every layer: those of layers 0 and 1 would show), as SGLang's `kv_layer_ids` name them.
    Kimi-Linear's full layers are MLA: its latent converts unscaled (a checkpoint without MLA
    KV scales; others are refused, `manager.model.latent_scales`). The Mamba state moves as
    bytes, as in another dtype's absence; every other byte and slot keeps its poison."""
    room = 7600 + 10 * prefill[0] + decode[0] + slots[0]
    fields = _mamba_fields(kind, slots, (prefill[0], decode[0]))
    _, decodes, cfgs = _run_pair(
        request.getfixturevalue(f"{kind}_dir"), bootstrap_port, room, prefill, decode,
        faults=fields, kv_heads=KV_HEADS, kv_dtypes=kv_dtypes, mla=kind == "kda",
    )  # fmt: skip
    assert mamba_geometry(cfgs[0]).full_layers == (1, 3)
    for result, cfg in zip(decodes, cfgs, strict=True):
        rank = f"decode rank {cfg.tp_rank} of TP {cfg.tp_size}"
        got, want = torch.from_numpy(result["held"]), torch.from_numpy(result["converted"])
        assert got.shape == want.shape, f"{rank}: KV of {got.shape}"
        assert torch.equal(got, want), (
            f"{rank}: {int((got != want).sum())} of {want.numel()} differ, in layers "
            f"{(got != want).flatten(1).any(1).nonzero().flatten().tolist()} of the pool's"
        )
        assert result["untouched"], f"{rank} wrote KV outside the request's pages"
        assert result["aux"] == (1000 + room % 1000, room)
        _assert_state_moved(result, cfg)


def test_the_oracle_is_sglangs_own_slicing_of_a_gated_delta_net(gdn_dir):
    """The test's sharding rule agrees with SGLang's own for a gated delta net, which names its
    sub-blocks (`compute_mamba_state_slice_blocks`, scatter from TP 1 to each rank of TP 2 and
    TP 4): the oracle is not kvxfer's rule restated."""
    from sglang.srt.disaggregation.utils import compute_mamba_state_slice_blocks

    whole = RankConfig("decode", 1, 0, 16, gdn_dir, 0, 0, 1, [1], 0, mamba="gdn")
    conv, temporal = global_mamba(whole)
    segments = [rows for rows, _ in mamba_geometry(whole).segments]
    channels = conv.shape[1]
    for tp in (2, 4):
        for rank in range(tp):
            cfg = RankConfig("decode", tp, rank, 16, gdn_dir, 0, 0, 1, [1], 0, mamba="gdn")
            blocks = compute_mamba_state_slice_blocks(
                src_dim=channels, dst_dim=channels // tp, src_attn_tp_size=1,
                dst_attn_tp_size=tp, dst_tp_rank_in_group=rank, local_tp_rank_in_group=0,
                conv_shard_groups=segments,
            )  # fmt: skip
            # (source start, destination start, length), destinations back to back
            assert [b[1] for b in blocks] == [sum(segments[:i]) // tp for i in range(3)]
            sglangs = torch.cat([conv[:, start : start + n] for start, _, n in blocks], 1)
            ours, _ = mamba_of_rank(cfg, conv, temporal)
            assert attn_tp(cfg) == (tp, rank)
            assert torch.equal(sglangs.view(torch.int16), ours.view(torch.int16)), (tp, rank)


def test_the_oracle_is_sglangs_own_slicing_of_a_channels_last_kda_conv(kda_dir):
    """The test's sharding rule agrees with SGLang's own for Kimi's KDA conv, `[K - 1,
    channels]` a slot (`compute_mamba_state_slice_byte_blocks` with the window rows as its
    `outer_count` and q | k | v as its sub-blocks): scatter from TP 1 to each rank of TP 2 and
    TP 4, and aggregation from every rank of TP 2 and TP 4 into TP 1, byte for byte."""
    from sglang.srt.disaggregation.utils import compute_mamba_state_slice_byte_blocks

    def kda(tp: int, rank: int) -> RankConfig:
        return RankConfig("decode", tp, rank, 16, kda_dir, 0, 0, 1, [1], 0, mla=True, mamba="kda")

    geo = mamba_geometry(kda(1, 0))
    assert geo.channels_last and geo.window == 3
    conv, temporal = global_mamba(kda(1, 0))
    groups = [rows for rows, _ in geo.segments]
    channels = conv.shape[2]

    def items(state: Any) -> Any:  # a slot's bytes, per state layer
        return state.contiguous().view(torch.uint8).flatten(1)

    def moved(source: Any, into: Any, **fields: Any) -> None:
        blocks = compute_mamba_state_slice_byte_blocks(
            src_item_len=source.shape[1], dst_item_len=into.shape[1], outer_count=geo.window,
            conv_shard_groups=groups, **fields,
        )  # fmt: skip
        assert len(blocks) == 3 * geo.window, blocks  # a q, k and v block a window row
        for src, dst, n in blocks:
            into[:, dst : dst + n] = source[:, src : src + n]

    whole = items(conv)
    for tp in (2, 4):
        parts = [items(mamba_of_rank(kda(tp, rank), conv, temporal)[0]) for rank in range(tp)]
        gathered = torch.zeros_like(whole)
        for rank, part in enumerate(parts):
            scattered = torch.zeros_like(part)
            moved(
                whole, scattered, src_dim=channels, dst_dim=channels // tp, src_attn_tp_size=1,
                dst_attn_tp_size=tp, dst_tp_rank_in_group=rank, local_tp_rank_in_group=0,
            )  # fmt: skip
            assert torch.equal(scattered, part), f"scatter 1 -> {tp}: rank {rank}"
            moved(
                part, gathered, src_dim=channels // tp, dst_dim=channels, src_attn_tp_size=tp,
                dst_attn_tp_size=1, dst_tp_rank_in_group=0, local_tp_rank_in_group=rank,
            )  # fmt: skip
        assert torch.equal(gathered, whole), f"aggregation {tp} -> 1"


def _refusals(configs: list[RankConfig]) -> list[str]:
    """Run the ranks, each until its manager is built (or refused): the errors they report."""
    ctx = _rank_context()
    pipes, procs, errors = [], [], []
    for cfg in configs:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=run_rank, args=(cfg, child), daemon=True)
        proc.start()
        child.close()
        pipes.append(parent)
        procs.append(proc)
    try:
        for pipe in pipes:
            assert pipe.poll(RANK_HANG_S), "a rank did not answer"
            status, value = pipe.recv()
            errors.append(value if status == "error" else "")
    finally:
        for pipe, proc in zip(pipes, procs, strict=True):
            with contextlib.suppress(OSError):
                pipe.send("bye")
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    return errors


def _prefill(model_dir: str, kind: str, tp: int, rank: int = 0, **fields: Any) -> RankConfig:
    return RankConfig(
        "prefill", tp, rank, 16, model_dir, free_port(), 8000, 32, [1, 2], 0, mamba=kind,
        mamba_slot=1, kv_heads=KV_HEADS, **fields,
    )  # fmt: skip


def _assert_refused(errors: list[str], *words: str) -> None:
    for error in errors:
        reason = error.strip().splitlines()[-1] if error else "(built)"
        assert reason.startswith("ValueError") and all(w in reason for w in words), error


def test_a_mamba_prefill_with_pipeline_stages_sends_each_stages_state(gdn_dir, bootstrap_port):
    """Prefill TP 1 x PP 2 (stage 0: layers 0-1, its state layer 0 and full layer 1; stage 1:
    layers 2-3; SGLang's PP group on gloo) -> decode TP 2: each decode rank reads each state
    layer and each KV layer from the stage that holds it, placed by SGLang's layer ids among
    the model's state and full-attention layers, bit for bit."""
    room = 7950
    fields = _mamba_fields("gdn", (2, 5), (1, 2))
    prefills, decodes, cfgs = _run_pair(
        gdn_dir, bootstrap_port, room, (1, 16), (2, 32), pp_size=2, faults=fields,
        kv_heads=KV_HEADS,
    )  # fmt: skip
    assert sorted(p["pp_rank"] for p in prefills) == [0, 1]
    want_kv = global_kv(cfgs[0]).view(torch.int16)[list(mamba_geometry(cfgs[0]).full_layers)]
    for result, cfg in zip(decodes, cfgs, strict=True):
        rank = f"decode rank {cfg.tp_rank} of TP {cfg.tp_size}"
        got = torch.from_numpy(result["held"])
        assert torch.equal(got, want_kv[:, :, :, heads_of(cfg)]), f"{rank}: full-attention KV"
        assert result["untouched"], f"{rank} wrote KV outside the request's pages"
        _assert_state_moved(result, cfg)


@pytest.mark.parametrize(
    ("prefill", "decode", "slots"),
    [((1, 16), (2, 32), (3, 5)), ((2, 16), (1, 16), (2, 2))],
    ids=["tp1-tp2", "tp2-tp1"],
)
def test_a_mamba_models_draft_kv_moves_beside_its_state(
    gdn_dir, draft_dir, bootstrap_port, prefill, decode, slots
):
    """EAGLE with a hybrid target: SGLang registers the draft's pool after the target's
    full-attention layers (their ids in a band above the target's, `build_kv_layer_ids`) and no
    state of the draft's; the draft's KV rides on the target's pages, its heads resharded, beside
    the target's KV and Mamba state, every one bit for bit."""
    room = 7900 + 10 * prefill[0] + decode[0]
    fields = _mamba_fields("gdn", slots, (prefill[0], decode[0]))
    prefills, decodes, cfgs = _run_pair(
        gdn_dir, bootstrap_port, room, prefill, decode, faults=fields, kv_heads=KV_HEADS,
        draft_dir=draft_dir,
    )  # fmt: skip
    want_kv = global_kv(cfgs[0]).view(torch.int16)[list(mamba_geometry(cfgs[0]).full_layers)]
    want_draft = global_kv(draft_config(cfgs[0])).view(torch.int16)
    held = torch.cat([torch.from_numpy(p["draft_held"]) for p in prefills], 3)
    assert torch.equal(held, want_draft), "the prefill draft pools hold other KV than written"
    for result, cfg in zip(decodes, cfgs, strict=True):
        rank = f"decode rank {cfg.tp_rank} of TP {cfg.tp_size}"
        got = torch.from_numpy(result["held"])
        assert torch.equal(got, want_kv[:, :, :, heads_of(cfg)]), f"{rank}: full-attention KV"
        draft = torch.from_numpy(result["draft_held"])
        assert torch.equal(draft, want_draft[:, :, :, heads_of(draft_config(cfg))]), rank
        assert result["untouched"], f"{rank} wrote KV outside the request's pages"
        _assert_state_moved(result, cfg)
