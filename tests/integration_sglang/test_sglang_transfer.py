"""kvxfer as SGLang's transfer backend, against SGLang's own classes (`make test-sglang`).

Each rank is a process set up as SGLang's scheduler sets one up (`ranks.py`): SGLang's pool
allocates the KV, SGLang's `set_kv_buffer` writes it, the backend's classes come from SGLang's
`get_kv_class` after the plugin loaded through its entry point, and SGLang's bootstrap server
(the backend's, built by `get_kv_class` as SGLang's disagg service builds it) joins them. Every
decode byte is compared with what the prefill ranks' pools hold, and every byte outside the
request's pages must keep its poison.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from ranks import (
    DRAFT_KV_HEADS,
    DRAFT_LAYERS,
    POISON_BYTE,
    WAIT_S,
    RankConfig,
    draft_config,
    fetched_window,
    global_kv,
    heads_of,
    run_rank,
    window_layers,
)

from kvxfer.addresses import free_port

POISON_WORD = POISON_BYTE << 8 | POISON_BYTE  # a poisoned bf16, as the int16 it is read as
# How long a rank may take to answer (start, import SGLang, transfer): a guard against a hang
# only, since a rank that exits is seen at once. A loaded machine stalls processes for seconds.
RANK_HANG_S = 600.0

TOKENS = 100  # not a whole number of pages: the last page is partial on both sides


def _model(path: Path, kv_heads: int, layers: int = 4, windowed: bool = False) -> str:
    """A tiny Llama config with `kv_heads` KV heads of 16 and `layers` layers: what SGLang's
    `ModelConfig` reads. `windowed`: a sliding-window model, its odd layers window layers (a
    custom model's opt-in: SGLang's `ModelConfig` then splits the layers as its `SWAKVPool`
    keeps them, the harness's `window_layers`)."""
    config: dict[str, object] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 192,
        "intermediate_size": 256,
        "num_attention_heads": 12,
        "num_key_value_heads": kv_heads,
        "head_dim": 16,
        "num_hidden_layers": layers,
        "vocab_size": 256,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if windowed:
        config |= {"is_hybrid_swa": True, "hybrid_layer_pattern": [i % 2 for i in range(layers)]}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """12 KV heads: TP 2, 3, 4 and 6 all shard them."""
    return _model(tmp_path_factory.mktemp("model"), 12)


@pytest.fixture(scope="module")
def window_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """`model_dir`'s model with sliding-window attention in its odd layers."""
    return _model(tmp_path_factory.mktemp("window-model"), 12, windowed=True)


@pytest.fixture(scope="module")
def draft_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An EAGLE draft model: one layer, 4 KV heads (its own pool beside the target's)."""
    return _model(tmp_path_factory.mktemp("draft-model"), DRAFT_KV_HEADS, DRAFT_LAYERS)


@pytest.fixture(scope="module")
def gqa_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """2 KV heads: TP 4 replicates each on two ranks."""
    return _model(tmp_path_factory.mktemp("gqa-model"), 2)


@pytest.fixture
def bootstrap_port() -> Iterator[int]:
    """The backend's bootstrap server, as SGLang's disagg service starts it on the prefill
    (one per prefill engine: it keeps the first registrant's sizes)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()  # before importing get_kv_class: the plugin's hook rebinds it
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    port = free_port()
    server = get_kv_class(TransferBackend("kvxfer"), KVClassType.BOOTSTRAP_SERVER)(
        host="127.0.0.1", port=port
    )
    yield port
    server.close()


def _pages(count: int, pool_pages: int, seed: int) -> list[int]:
    """`count` distinct pages in a pool, never page 0 (SGLang's padding page), out of order."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(pool_pages - 1, generator=g)[:count] + 1).tolist()


# SGLang's modules cost a rank process about 10 s of CPU to import: a forkserver that imported
# them once forks every rank (a fresh process that did nothing else: no threads, no sockets).
_PRELOAD = [
    "ranks",
    "sglang.srt.disaggregation.base.conn",
    "sglang.srt.disaggregation.utils",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.runtime_context",
    "sglang.srt.server_args",
    "sglang.srt.disaggregation.prefill",
    "sglang.srt.disaggregation.decode",
]


def _rank_context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _run_pair(
    model_dir: str,
    port: int,
    room: int,
    prefill: tuple[int, int],
    decode: tuple[int, int],
    pp_size: int = 1,
    mla: bool = False,
    faults: dict[tuple[str, int], dict] | None = None,
    kv_heads: int = 12,
    dp: tuple[int, int] = (1, 1),
    serving_dp: tuple[int, int] = (0, 0),
    load_balance_method: str = "follow_bootstrap_room",
    kv_dtypes: tuple[str, str] = ("auto", "auto"),
    draft_dir: str = "",
    window: int = 0,
) -> tuple[list[dict], list[dict], list[RankConfig]]:
    """Prefill TP `prefill[0]` with pages of `prefill[1]` tokens (and `pp_size` stages) ->
    decode TP `decode[0]`, pages of `decode[1]`; every rank in its own process; `mla`: SGLang's
    MLA pool on both sides; `faults`: RankConfig fields by (role, TP rank). `dp`: the prefill's
    and the decode's DP attention sizes, `serving_dp` the DP groups the request is routed to
    (the other groups' ranks start and register, and are left out of the results);
    `kv_dtypes`: the prefill's and the decode's `--kv-cache-dtype`; `draft_dir`: an EAGLE draft
    model on both sides; `window`: a sliding-window model's window (SGLang's `SWAKVPool`). A
    rank killed on purpose answers None."""
    ctx = _rank_context()
    configs = []
    pool_tokens = 512
    dist_port = free_port()  # the prefill's process groups, where a case builds them
    for side, (role, (tp, page)) in enumerate((("prefill", prefill), ("decode", decode))):
        pages = _pages(-(-TOKENS // page), pool_tokens // page, seed=room + tp)
        window_pages = _pages(len(pages), pool_tokens // page, seed=room + tp + 77)
        stages = pp_size if role == "prefill" else 1
        attn_tp = tp // dp[side]
        for pp_rank in range(stages):
            for rank in range(tp):
                configs.append(
                    RankConfig(
                        role, tp, rank, page, model_dir, port, room, TOKENS, pages,
                        aux_index=3 if role == "prefill" else 5, pp_size=stages,
                        pp_rank=pp_rank, pool_tokens=pool_tokens, seed=room, mla=mla,
                        kv_heads=kv_heads, dp_size=dp[side],
                        serves=rank // attn_tp == serving_dp[side],
                        load_balance_method=load_balance_method, dist_port=dist_port,
                        kv_dtype=kv_dtypes[side], peer_kv_dtype=kv_dtypes[1 - side],
                        draft_dir=draft_dir, window=window,
                        window_pages=window_pages if window else [],
                        **(faults or {}).get((role, rank), {}),
                    )
                )  # fmt: skip
    pipes, procs = [], []
    for cfg in configs:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=run_rank, args=(cfg, child), daemon=True)
        proc.start()
        child.close()  # the rank's end lives in the rank only: its exit is our EOF
        pipes.append(parent)
        procs.append(proc)
    results, errors = [], []
    try:
        for cfg, pipe in zip(configs, pipes, strict=True):
            name = f"{cfg.role} rank {cfg.pp_rank}/{cfg.tp_rank}"
            if cfg.killed_before_send:
                procs[configs.index(cfg)].join(WAIT_S)
                results.append(None)
                continue
            # A rank that exits is seen at once (EOF); the bound only guards against a hang.
            if not pipe.poll(RANK_HANG_S):
                errors.append(f"{name} did not answer in {RANK_HANG_S} s")
                continue
            try:
                status, value = pipe.recv()
            except EOFError:
                proc = procs[configs.index(cfg)]
                proc.join(10)
                errors.append(f"{name} exited (code {proc.exitcode}) without an answer")
                continue
            if status != "ok":
                errors.append(f"{name}:\n{value}")
            results.append(value)
        assert not errors, "\n".join(errors)
    finally:
        for pipe in pipes:
            with contextlib.suppress(OSError):  # a rank killed on purpose
                pipe.send("bye")
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    serving = [(r, c) for r, c in zip(results, configs, strict=True) if c.serves]
    prefills = [r for r, c in serving if c.role == "prefill"]
    decodes = [r for r, c in serving if c.role == "decode"]
    return prefills, decodes, [c for _, c in serving if c.role == "decode"]


def _prefill_held(prefills: list[dict]) -> torch.Tensor:
    """What the prefill pools hold (MHA): heads side by side within a stage, stages one after
    another."""
    stages = sorted({p["pp_rank"] for p in prefills})
    return torch.cat(
        [
            torch.cat([torch.from_numpy(p["held"]) for p in prefills if p["pp_rank"] == s], 3)
            for s in stages
        ]
    )


def _assert_exact(prefills: list[dict], decodes: list[dict], decode_cfgs: list[RankConfig]):
    """Each decode rank holds its heads of every layer exactly as the prefill pools hold them,
    and nothing else changed."""
    # The prefill pools' heads, side by side: what SGLang's set_kv_buffer wrote.
    want_all = global_kv(decode_cfgs[0]).view(torch.int16)
    if decode_cfgs[0].mla:  # every prefill rank of a stage holds the whole latent cache
        stages = [torch.from_numpy(p["held"]) for p in prefills if p["tp_rank"] == 0]
        held = torch.cat(stages, dim=0)
        assert all(torch.equal(torch.from_numpy(p["held"]), held[p["layers"]]) for p in prefills)
    else:
        held = _prefill_held(prefills)
    assert torch.equal(held, want_all), "the prefill pools hold other KV than SGLang was given"
    for result, cfg in zip(decodes, decode_cfgs, strict=True):
        want = held if cfg.mla else held[:, :, :, heads_of(cfg)]
        got = torch.from_numpy(result["held"])
        assert torch.equal(got, want), (
            f"decode rank {cfg.tp_rank}: {int((got != want).sum())} of {want.numel()} differ"
        )
        assert result["untouched"], f"decode rank {cfg.tp_rank} wrote outside the request"
        assert result["aux"] == (1000 + cfg.room % 1000, cfg.room)


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [
        ((2, 16), (4, 16)),
        ((3, 16), (4, 16)),
        ((4, 16), (2, 16)),
        ((2, 16), (2, 64)),
        ((2, 64), (3, 1)),
        ((4, 16), (6, 32)),
    ],
    ids=["tp2-tp4", "tp3-tp4", "tp4-tp2", "page16-page64", "page64-tp3-page1", "tp4-tp6-page32"],
)
def test_a_request_moves_bit_exact(model_dir, bootstrap_port, prefill, decode):
    room = 1000 + 10 * prefill[0] + decode[0] + decode[1]
    prefills, decodes, cfgs = _run_pair(model_dir, bootstrap_port, room, prefill, decode)
    # KVPoll in SGLang's order: Bootstrapping, WaitingForInput, Transferring (published),
    # Success; a decode rank WaitingForInput until its fetch and aux row are in.
    # (A decode's metadata may reach a prefill rank before its sender exists: Bootstrapping
    # is then never seen.)
    for states in (p["states"] for p in prefills):
        assert states == sorted(states) and states[-2:] == [3, 4] and set(states) <= {1, 2, 3, 4}
    assert all(d["states"][-2:] == [2, 4] for d in decodes), [d["states"] for d in decodes]
    _assert_exact(prefills, decodes, cfgs)


@pytest.mark.parametrize(
    ("prefill", "decode", "kv_dtypes", "mla"),
    [
        ((1, 16), (2, 32), ("auto", "fp8_e4m3"), False),
        ((2, 64), (3, 16), ("auto", "fp8_e5m2"), False),
        ((2, 16), (1, 64), ("fp8_e4m3", "auto"), False),
        ((1, 16), (2, 32), ("auto", "fp8_e4m3"), True),
        ((2, 16), (1, 64), ("fp8_e4m3", "auto"), True),
    ],
    ids=[
        "bf16-tp1-e4m3-tp2", "bf16-page64-e5m2-tp3", "e4m3-tp2-bf16-tp1", "mla-bf16-e4m3",
        "mla-e4m3-bf16",
    ],
)  # fmt: skip
def test_a_request_changes_dtype_as_the_decode_writes_it(
    model_dir, bootstrap_port, prefill, decode, kv_dtypes, mla
):
    """A prefill and a decode of other `--kv-cache-dtype`s (SGLang's own transfer backends
    refuse them): into fp8, the decode holds what SGLang's own fp8 write (`set_kv_buffer` with
    the layer's scales; an MLA pool's casts the latent with none, whatever the layer's scale)
    makes of the prefill's KV; out of fp8, the prefill's fp8 KV times its scales (MLA: cast).
    Every other byte keeps its poison."""
    room = 1700 + 10 * prefill[0] + decode[0] + 5 * mla
    _, decodes, cfgs = _run_pair(
        model_dir, bootstrap_port, room, prefill, decode, kv_dtypes=kv_dtypes, mla=mla
    )
    for result, cfg in zip(decodes, cfgs, strict=True):
        got, want = torch.from_numpy(result["held"]), torch.from_numpy(result["converted"])
        assert torch.equal(got, want), (
            f"decode rank {cfg.tp_rank}: {int((got != want).sum())} of {want.numel()} differ"
        )
        assert result["untouched"], f"decode rank {cfg.tp_rank} wrote outside the request"
        assert result["aux"] == (1000 + cfg.room % 1000, cfg.room)


@pytest.mark.parametrize(
    ("prefill", "decode"), [((2, 16), (4, 32)), ((1, 64), (2, 16))], ids=["tp2-tp4", "tp1-tp2"]
)
def test_speculative_decodings_draft_kv_moves_with_the_target(
    model_dir, draft_model_dir, bootstrap_port, prefill, decode
):
    """EAGLE: the draft model's own pool (its heads, its layer) rides on the target's pages,
    as SGLang appends it to the backend's buffers; each decode rank's draft pool holds its
    heads of what the prefill's draft pools hold, and the target moves as ever."""
    room = 1800 + 10 * prefill[0] + decode[0]
    prefills, decodes, cfgs = _run_pair(
        model_dir, bootstrap_port, room, prefill, decode, draft_dir=draft_model_dir
    )
    _assert_exact(prefills, decodes, cfgs)
    held = torch.cat([torch.from_numpy(p["draft_held"]) for p in prefills], 3)
    assert held.shape[:2] == (DRAFT_LAYERS, 2)
    assert torch.equal(held, global_kv(draft_config(cfgs[0])).view(torch.int16))
    for result, cfg in zip(decodes, cfgs, strict=True):
        want = held[:, :, :, heads_of(draft_config(cfg))]
        got = torch.from_numpy(result["draft_held"])
        assert torch.equal(got, want), f"decode rank {cfg.tp_rank}: its draft KV differs"


WINDOW = 40  # tokens: the window's start falls inside a page on both sides of every case


@pytest.mark.parametrize(
    ("prefill", "decode"), [((1, 16), (2, 32)), ((2, 32), (3, 16))], ids=["tp1-tp2", "tp2-tp3"]
)
def test_a_sliding_window_models_window_moves_beside_its_full_layers(
    window_model_dir, bootstrap_port, prefill, decode
):
    """SGLang's `SWAKVPool` (full layers, and window layers in a pool of their own, addressed by
    the window pages SGLang hands the backend as its "swa" state indices): the full layers move
    whole; the window layers the tokens the decode's first query attends to, into the decode's
    window pages, never from a prefill page before the window (SGLang frees those: overwritten
    here), and nothing else of the decode's window pool is written."""
    room = 1900 + 10 * prefill[0] + decode[0]
    prefills, decodes, cfgs = _run_pair(
        window_model_dir, bootstrap_port, room, prefill, decode, window=WINDOW
    )
    _assert_window_exact(prefills, decodes, cfgs)


def test_a_sliding_window_prefill_with_pipeline_stages_sends_each_stages_layers(
    window_model_dir, bootstrap_port
):
    """Prefill TP 1 x PP 2 -> decode TP 2: each stage keeps one full and one window layer
    (SGLang's model runner cuts both kinds to the stage), placed among the model's layers of
    their kind: the decode reads layers 0 and 1 from stage 0, layers 2 and 3 from stage 1."""
    prefills, decodes, cfgs = _run_pair(
        window_model_dir, bootstrap_port, 5101, (1, 16), (2, 32), pp_size=2, window=WINDOW
    )
    assert all(p["states"][-1] == 4 for p in prefills), [p["states"] for p in prefills]
    assert sorted((p["pp_rank"], p["layers"].start) for p in prefills) == [(0, 0), (1, 2)]
    _assert_window_exact(prefills, decodes, cfgs)


@pytest.mark.parametrize(
    ("prefill", "decode", "kv_dtypes"),
    [((1, 16), (2, 32), ("auto", "fp8_e4m3")), ((2, 16), (1, 64), ("fp8_e4m3", "auto"))],
    ids=["bf16-tp1-e4m3-tp2", "e4m3-tp2-bf16-tp1"],
)
def test_a_sliding_window_model_changes_dtype_with_each_layers_scales(
    window_model_dir, bootstrap_port, prefill, decode, kv_dtypes
):
    """fp8 on one side of a sliding-window model: the full and the window layers convert with
    their own layers' scales (each pool's layers by their global ids); the decode holds what
    SGLang's own write makes (into fp8), or the prefill's fp8 times its scales (out of it), of
    every full-layer token and the window layers' fetched tokens."""
    room = 1950 + 10 * prefill[0] + decode[0]
    _, decodes, cfgs = _run_pair(
        window_model_dir, bootstrap_port, room, prefill, decode, kv_dtypes=kv_dtypes,
        window=WINDOW,
    )  # fmt: skip
    full, window, tokens = [0, 2], window_layers(cfgs[0]), list(fetched_window(cfgs[0]))
    for result, cfg in zip(decodes, cfgs, strict=True):
        got, want = torch.from_numpy(result["held"]), torch.from_numpy(result["converted"])
        assert torch.equal(got[full], want[full]), f"decode rank {cfg.tp_rank}: full layers"
        window_got = got[window][:, :, tokens]
        assert torch.equal(window_got, want[window][:, :, tokens]), f"rank {cfg.tp_rank}: window"
        assert result["untouched"], f"decode rank {cfg.tp_rank} wrote outside the window"


def test_a_sliding_window_models_draft_kv_moves_beside_both_pools(
    window_model_dir, draft_model_dir, bootstrap_port
):
    """EAGLE with a sliding-window target: the draft's pool (full attention, its own heads)
    follows the target's full pool in `KVArgs`, the window pool is a state of the target's
    alone; the draft rides on the target's pages beside both, every one bit for bit."""
    prefills, decodes, cfgs = _run_pair(
        window_model_dir, bootstrap_port, 5201, (1, 16), (2, 32), window=WINDOW,
        draft_dir=draft_model_dir,
    )  # fmt: skip
    _assert_window_exact(prefills, decodes, cfgs)
    held = torch.cat([torch.from_numpy(p["draft_held"]) for p in prefills], 3)
    assert torch.equal(held, global_kv(draft_config(cfgs[0])).view(torch.int16))
    for result, cfg in zip(decodes, cfgs, strict=True):
        want = held[:, :, :, heads_of(draft_config(cfg))]
        got = torch.from_numpy(result["draft_held"])
        assert torch.equal(got, want), f"decode rank {cfg.tp_rank}: its draft KV differs"


def _assert_window_exact(prefills: list[dict], decodes: list[dict], cfgs: list[RankConfig]):
    """The prefill pools hold SGLang's writes of the full layers' tokens and of the window
    layers' fetched tokens; each decode rank its heads of those, and nothing else written."""
    full, window = [0, 2], window_layers(cfgs[0])
    tokens = list(fetched_window(cfgs[0]))
    want_all = global_kv(cfgs[0]).view(torch.int16)
    held = _prefill_held(prefills)
    assert torch.equal(held[full], want_all[full])
    assert torch.equal(held[window][:, :, tokens], want_all[window][:, :, tokens])
    for result, cfg in zip(decodes, cfgs, strict=True):
        got, want = torch.from_numpy(result["held"]), want_all[:, :, :, heads_of(cfg)]
        assert torch.equal(got[full], want[full]), f"decode rank {cfg.tp_rank}: full layers"
        window_got = got[window][:, :, tokens]
        assert torch.equal(window_got, want[window][:, :, tokens]), f"rank {cfg.tp_rank}: window"
        assert result["untouched"], f"decode rank {cfg.tp_rank} wrote outside the window"
        assert result["aux"] == (1000 + cfg.room % 1000, cfg.room)


def test_gqa_heads_replicated_on_the_decode(gqa_model_dir, bootstrap_port):
    prefills, decodes, cfgs = _run_pair(
        gqa_model_dir, bootstrap_port, 1500, (2, 16), (4, 32), kv_heads=2
    )
    assert all(p["states"][-1] == 4 for p in prefills), [p["states"] for p in prefills]
    _assert_exact(prefills, decodes, cfgs)


@pytest.mark.parametrize(
    ("prefill", "decode"), [((2, 16), (4, 16)), ((2, 64), (1, 1))], ids=["tp2-tp4", "page64-page1"]
)
def test_an_mla_cache_moves_from_one_source(model_dir, bootstrap_port, prefill, decode):
    room = 3000 + prefill[1] + decode[0]
    prefills, decodes, cfgs = _run_pair(model_dir, bootstrap_port, room, prefill, decode, mla=True)
    assert all(p["states"][-1] == 4 for p in prefills), [p["states"] for p in prefills]
    _assert_exact(prefills, decodes, cfgs)


def test_a_prefill_rank_killed_before_it_sends_fails_the_decode_with_its_pages(
    model_dir, bootstrap_port
):
    # TP 2 -> TP 2: decode rank 0 reads only from prefill rank 0, which dies (SIGKILL) once
    # bootstrapped; prefill rank 1 publishes.
    prefills, decodes, cfgs = _run_pair(
        model_dir, bootstrap_port, 4001, (2, 16), (2, 32),
        faults={("prefill", 0): {"killed_before_send": True}},
    )  # fmt: skip
    # Prefill rank 1 concludes either way SGLang allows: `Success` when decode rank 0's failed
    # fetch released it first, `Failed` when that rank's ABORT (SGLang's decode fails the
    # request whole) came first. Both free its pages; the order is a race between two sockets.
    survivor = prefills[1]
    assert prefills[0] is None and survivor["states"][-1] in (0, 4), survivor["states"]
    if survivor["states"][-1] == 0:
        assert "decode engine aborted" in survivor["reason"], survivor["reason"]
    dead, alive = decodes
    assert dead["states"][-1] == 0, dead["states"]  # KVPoll.Failed
    assert f"pages {sorted(cfgs[0].pages)}" in dead["reason"], dead["reason"]
    assert dead["untouched"], "a failed load wrote outside its pages"
    # Decode rank 1 races the same ABORT: `Success` with prefill rank 1's heads when its read
    # came first, `Failed` naming the released request when the ABORT did. SGLang's decode
    # polls its ranks together, so the request fails whole either way; nothing is corrupted.
    assert alive["untouched"], "the surviving decode rank wrote outside its pages"
    if alive["states"][-1] == 4:
        assert torch.equal(torch.from_numpy(alive["held"]), torch.from_numpy(survivor["held"]))
    else:
        assert alive["states"][-1] == 0, alive["states"]
        assert "already released" in alive["reason"], alive["reason"]


def test_a_decode_abort_frees_the_prefill_and_writes_nothing(model_dir, bootstrap_port):
    prefills, decodes, _ = _run_pair(
        model_dir, bootstrap_port, 4002, (2, 16), (2, 16),
        faults={("decode", r): {"abort_after_metadata": True} for r in range(2)},
    )  # fmt: skip
    # The producers released the request at once (kvxfer's abort), so SGLang frees the
    # prefill's pages; the decode reports the abort and its pool keeps its poison everywhere.
    assert all(p["states"][-1] in (0, 4) for p in prefills), [p["states"] for p in prefills]
    for result in decodes:
        assert result["states"][-1] == 0 and "Aborted" in result["reason"], result
        assert result["untouched"]
        poison = torch.full_like(torch.from_numpy(result["held"]), POISON_WORD)
        assert torch.equal(torch.from_numpy(result["held"]), poison)


def test_an_abort_without_the_secret_cannot_end_a_request_being_read(model_dir, bootstrap_port):
    """SGLang's unsigned ABORT and an `Abandoned` under another secret, for a request that the
    decode ranks (with the secret) read: the prefill drops both, and the request moves."""
    prefills, decodes, cfgs = _run_pair(
        model_dir, bootstrap_port, 4005, (2, 16), (2, 16),
        faults={("decode", r): {"forged_aborts": True} for r in range(2)},
    )  # fmt: skip
    assert all(p["states"][-1] == 4 for p in prefills), [p["states"] for p in prefills]
    assert all(d["states"][-1] == 4 for d in decodes), [d["reason"] for d in decodes]
    _assert_exact(prefills, decodes, cfgs)


def test_a_decode_with_the_wrong_secret_is_refused_and_the_prefill_freed(model_dir, bootstrap_port):
    secret = {"env": {"KVXFER_CONFIG": '{"secret": "prefill-secret"}'}}
    wrong = {"env": {"KVXFER_CONFIG": '{"secret": "guess"}'}}
    prefills, decodes, _ = _run_pair(
        model_dir, bootstrap_port, 4003, (1, 16), (1, 16),
        faults={("prefill", 0): secret, ("decode", 0): wrong},
    )  # fmt: skip
    (decode,) = decodes
    assert decode["states"][-1] == 0 and "secret" in decode["reason"], decode["reason"]
    # Refused at its registration: it never learned a side channel or the request's aux row.
    assert "refused this decode engine's registration" in decode["reason"], decode["reason"]
    assert decode["aux"] == (0, 0) and decode["untouched"]
    # SGLang's decode tells the prefill (`Abandoned`, under the wrong secret: honoured, as no
    # decode rank proved that it reads the request), whose sender fails: SGLang frees its pages.
    assert prefills[0]["states"][-1] == 0, prefills[0]["states"]
    assert "aborted" in prefills[0]["reason"]


def test_a_prefill_abort_fails_every_decode_rank_with_its_reason(model_dir, bootstrap_port):
    prefills, decodes, _ = _run_pair(
        model_dir, bootstrap_port, 4004, (2, 16), (2, 16),
        faults={("prefill", r): {"aborted_before_send": True} for r in range(2)},
    )  # fmt: skip
    assert all(p["states"][-1] == 0 for p in prefills), [p["states"] for p in prefills]
    for result in decodes:  # told at once (not after SGLang's waiting timeout), nothing written
        assert result["states"][-1] == 0, result["states"]
        assert "prefill engine aborted" in result["reason"], result["reason"]
        assert result["untouched"]


def _assert_stages(prefills: list[dict]) -> None:
    """Prefill TP 2 x PP 2 over 4 layers: stage 0 held layers 0-1, stage 1 layers 2-3."""
    assert sorted((p["pp_rank"], p["layers"].start) for p in prefills) == [
        (0, 0), (0, 0), (1, 2), (1, 2)
    ]  # fmt: skip


def test_an_mla_prefill_with_pipeline_stages_sends_each_stages_layers(model_dir, bootstrap_port):
    # Prefill TP 2 x PP 2 (SGLang's PP group on gloo: its PPConsensusStore gathers the stages'
    # states on stage 0) -> decode TP 1, pages of 1: the decode reads the latent cache of
    # layers 0-1 from stage 0 and of layers 2-3 from stage 1, one source each. (MHA with PP:
    # the bootstrap-queue test below.)
    prefills, decodes, cfgs = _run_pair(
        model_dir, bootstrap_port, 5001, (2, 16), (1, 1), pp_size=2, mla=True
    )
    assert all(p["states"][-1] == 4 for p in prefills), [p["states"] for p in prefills]
    _assert_stages(prefills)
    _assert_exact(prefills, decodes, cfgs)


@pytest.mark.parametrize(
    ("dp", "serving_dp", "load_balance_method"),
    [
        ((2, 1), (1, 0), "follow_bootstrap_room"),
        ((2, 1), (0, 0), "round_robin"),
        ((1, 2), (0, 1), "follow_bootstrap_room"),
    ],
    ids=["prefill-dp-follows-room", "prefill-dp-queried", "decode-dp"],
)
def test_dp_attention_reads_the_dp_group_sglang_picks(
    model_dir, bootstrap_port, dp, serving_dp, load_balance_method
):
    # TP 2 with DP attention 2 is two DP groups of attention TP 1, each holding all 12 heads of
    # its own requests. The prefill's group follows the room (room 5001: group 1), or, under
    # another load balance method, registers itself with the bootstrap server (/register_dp_rank)
    # and the decode asks it (/query_dp_ranks): group 0 is not the room's, so a decode that
    # guessed from the room would read the wrong group and time out.
    room = 5001 + 2 * sum(dp) + serving_dp[1]
    assert load_balance_method != "follow_bootstrap_room" or room % dp[0] == serving_dp[0]
    prefills, decodes, cfgs = _run_pair(
        model_dir, bootstrap_port, room, (2, 16), (2, 32), dp=dp, serving_dp=serving_dp,
        load_balance_method=load_balance_method,
    )  # fmt: skip
    assert len(prefills) == 2 // dp[0] and len(decodes) == 2 // dp[1]
    assert all(p["states"][-1] == 4 for p in prefills), [p["states"] for p in prefills]
    _assert_exact(prefills, decodes, cfgs)


def test_sglangs_prefill_bootstrap_queue_drives_the_backend(model_dir, bootstrap_port):
    # The prefill ranks (TP 2 x PP 2 -> decode TP 3) as SGLang's prefill scheduler runs them:
    # PrefillBootstrapQueue fills KVArgs and builds the manager, `add` makes the sender,
    # `pop_bootstrapped` (polls all-reduced over SGLang's attention TP group, then across the
    # stages) hands the request over once every decode rank sent its metadata, with the sender
    # `init` for its pages.
    via_queue = {"via_queue": True}
    prefills, decodes, cfgs = _run_pair(
        model_dir, bootstrap_port, 6002, (2, 16), (3, 32), pp_size=2,
        faults={("prefill", r): via_queue for r in range(2)},
    )  # fmt: skip
    assert all(p["states"][-1] == 4 for p in prefills), [p["states"] for p in prefills]
    _assert_stages(prefills)
    _assert_exact(prefills, decodes, cfgs)
