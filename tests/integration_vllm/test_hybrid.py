"""vLLM's hybrid memory allocator: a model whose even layers use full attention and odd layers
a sliding window of 24 tokens, as two KV cache groups with their own block tables (the groups'
tensors overlay one allocation, as vLLM lays them out). Prefill TP 2 (blocks of 16, LBNHC) ->
decode TP 3 (blocks of 32, LBHNC) under vLLM's Scheduler, which calls the connector's
`request_finished_all_groups` and gives the window group its null block for the blocks it
dropped. Checked on every decode rank before any decode compute: the full group holds every
prompt token bit for bit, the window group every token the next query attends to; the bytes
moved are exactly those (the window group moves only its window); the null block is never
written; blocks come back on both sides. Runs in the vLLM environment (`make test-vllm`)."""

from __future__ import annotations

import functools
import os

import pytest
from pd_engines import (
    HEAD_DIM,
    KV_HEADS,
    MODEL,
    Engine,
    EngineSpec,
    random_prompt,
    run_until,
    write_model,
)

_run_until = functools.partial(run_until, timeout=90.0)

LAYERS, WINDOW = 4, 24  # layers 0 and 2: full attention; 1 and 3: a window of 24 tokens
HYBRID_MODEL = {**MODEL, "num_hidden_layers": LAYERS}
COMMON = {"cost_model": "tcp_loopback", "secret": "s3cret"}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    model = write_model(tmp_path_factory.mktemp("model"), HYBRID_MODEL)
    specs = [
        EngineSpec(
            "prefill-hybrid", 2, 16, "kv_producer", 64, "LBNHC", COMMON, sliding_window=WINDOW
        ),
        EngineSpec(
            "decode-hybrid",
            3,
            32,
            "kv_consumer",
            48,
            "LBHNC",
            {**COMMON, "fetch_timeout_s": 20, "handshake_timeout_s": 5},
            sliding_window=WINDOW,
        ),
    ]
    started = [Engine(model, spec) for spec in specs]
    try:
        for engine in started:
            engine.wait_ready()
        yield started
    finally:
        for engine in started[::-1]:
            engine.close()


def _window_start(num_tokens: int) -> int:
    """vLLM's sliding-window manager keeps tokens from here (`get_num_skipped_tokens`)."""
    return max(0, num_tokens - WINDOW + 1)


def test_full_and_sliding_window_groups_move_bit_exact(engines):
    prefill, decode = engines
    prompts = {
        "hyb-a": random_prompt(11, 100),
        "hyb-b": random_prompt(12, 45),
        "hyb-c": random_prompt(13, 17),  # shorter than the window: every token moves
    }
    for request_id, prompt in prompts.items():
        prefill.add(request_id, prompt, max_tokens=1, params={"do_remote_decode": True})
    params: dict[str, dict] = {}

    def collect(engine, outputs):
        for o in outputs:
            if o.finish_reason is not None:
                params[o.request_id] = o.kv_transfer_params

    _run_until(lambda: len(params) == len(prompts), [prefill], on_step=collect)
    for request_id, prompt in prompts.items():
        tables = params[request_id]["remote_block_ids"]
        assert len(tables) == 2, "one block table per KV cache group"
        assert all(len(t) == -(-len(prompt) // 16) for t in tables)

    for request_id, prompt in prompts.items():
        decode.add(request_id, prompt, max_tokens=2, params=params[request_id])
    checked: dict[str, list[list[int]]] = {}
    first_compute: dict[str, int] = {}
    finished: set[str] = set()

    def follow(engine, outputs):
        if engine is not decode:
            return
        for request_id, count in engine.last_scheduled.items():
            first_compute.setdefault(request_id, count)
        for o in outputs:
            if o.finish_reason is not None:
                finished.add(o.request_id)
        for request_id in decode.finished_recving - set(checked):
            tables = decode.scheduler.kv_cache_manager.get_block_ids(request_id)
            prompt = prompts[request_id]
            window_table = tables[1]
            dropped = _window_start(len(prompt)) // 32
            assert all(b == 0 for b in window_table[:dropped]), "vLLM nulls dropped blocks"
            checked[request_id] = decode.check(prompt, [list(t) for t in tables], len(prompt))

    _run_until(
        lambda: finished == set(prompts) and prefill.finished_sending >= set(prompts),
        [decode, prefill],
        on_step=follow,
    )
    assert checked == {r: [[]] * 3 for r in prompts}, "KV differs on a decode rank"
    assert decode.null_block_untouched() == [True] * 3, "a dropped block was written"
    assert decode.invalid_block_ids == []
    assert first_compute == {r: 1 for r in prompts}
    # Exactly the full group's tokens and the window group's window crossed the wire.
    cell = 2 * KV_HEADS * HEAD_DIM * 2  # both planes of every head (over the 3 ranks), bf16
    per_layer_pair = sum(2 * len(p) - _window_start(len(p)) for p in prompts.values())
    moved = sum(s["bytes"] for s in decode.stats)
    assert moved == per_layer_pair * (LAYERS // 2) * cell
    assert prefill.free_blocks() == prefill.free_blocks_at_start
    assert decode.free_blocks() == decode.free_blocks_at_start


@pytest.fixture(scope="module")
def mamba_engines(tmp_path_factory):
    """A hybrid attention/Mamba2 model: prefill TP 2 (blocks of 16) -> decode TP 3 (blocks of
    32), the conv state stored channels first (VLLM_SSM_CONV_STATE_LAYOUT=DS, which both
    engines' processes inherit)."""
    model = write_model(tmp_path_factory.mktemp("mamba-model"), HYBRID_MODEL)
    before = os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT")
    os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = "DS"
    decode_extra = {**COMMON, "fetch_timeout_s": 20, "handshake_timeout_s": 5}
    specs = [
        EngineSpec("prefill-mamba", 2, 16, "kv_producer", 64, "LBNHC", COMMON, mamba=True),
        EngineSpec("decode-mamba", 3, 32, "kv_consumer", 48, "LBHNC", decode_extra, mamba=True),
    ]
    started = [Engine(model, spec) for spec in specs]
    try:
        for engine in started:
            engine.wait_ready()
        yield started
    finally:
        for engine in started[::-1]:
            engine.close()
        if before is None:
            os.environ.pop("VLLM_SSM_CONV_STATE_LAYOUT", None)
        else:
            os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = before


def test_mamba_state_is_resharded_and_the_last_token_recomputed(mamba_engines):
    prefill, decode = mamba_engines
    prompts = {"mam-a": random_prompt(21, 70), "mam-b": random_prompt(22, 9)}
    for request_id, prompt in prompts.items():
        prefill.add(request_id, prompt, max_tokens=4, params={"do_remote_decode": True})
    params: dict[str, dict] = {}

    def collect(engine, outputs):
        for o in outputs:
            if o.finish_reason is not None:
                params[o.request_id] = o.kv_transfer_params

    _run_until(lambda: len(params) == len(prompts), [prefill], on_step=collect)
    for request_id, prompt in prompts.items():
        # The prefill computed N - 1 tokens: its state is the one the decode continues from.
        assert params[request_id]["remote_num_tokens"] == len(prompt) - 1
        assert len(params[request_id]["remote_block_ids"]) == 2

    for request_id, prompt in prompts.items():
        decode.add(request_id, prompt, max_tokens=2, params=params[request_id])
    checked: dict[str, list[list[int]]] = {}
    first_compute: dict[str, int] = {}
    finished: set[str] = set()

    def follow(engine, outputs):
        if engine is not decode:
            return
        for request_id, count in engine.last_scheduled.items():
            first_compute.setdefault(request_id, count)
        for o in outputs:
            if o.finish_reason is not None:
                finished.add(o.request_id)
        for request_id in decode.finished_recving - set(checked):
            tables = [list(t) for t in decode.scheduler.kv_cache_manager.get_block_ids(request_id)]
            # Attention KV of N - 1 tokens and every layer's state after them, on every rank.
            loaded = len(prompts[request_id]) - 1
            checked[request_id] = decode.check(prompts[request_id], tables, loaded)

    _run_until(
        lambda: finished == set(prompts) and prefill.finished_sending >= set(prompts),
        [decode, prefill],
        on_step=follow,
    )
    assert checked == {r: [[]] * 3 for r in prompts}, "KV or state differs on a decode rank"
    assert decode.invalid_block_ids == []
    assert first_compute == {r: 1 for r in prompts}, "only the last prompt token is computed"
    assert prefill.free_blocks() == prefill.free_blocks_at_start
    assert decode.free_blocks() == decode.free_blocks_at_start
