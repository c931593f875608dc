"""vLLM's Scheduler drives a prefill engine (TP 2, blocks of 16, KV cache layout LBNHC) and a decode
engine (TP 3, blocks of 32, layout LBHNC) through the P/D flow with kvxfer's connector on both
sides: TP sizes that do not divide each other, different block sizes and layouts, KV tensors
allocated by vLLM's own allocator. Runs in the separate vLLM environment (`make test-vllm`)."""

from __future__ import annotations

import random
import time

import pytest
from pd_engines import (
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    VOCAB,
    Engine,
    EngineSpec,
    free_port_base,
    write_model,
)

PREFILL_TP, DECODE_TP = 2, 3
DECODE_BLOCK = 32


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    model = write_model(tmp_path_factory.mktemp("model"))
    port = free_port_base(PREFILL_TP)
    common = {"cost_model": "tcp_loopback", "secret": "s3cret"}
    prefill = Engine(
        model,
        EngineSpec(
            "prefill-engine",
            PREFILL_TP,
            16,
            "kv_producer",
            64,
            "LBNHC",
            {**common, "side_channel_port": port, "request_timeout_s": 120},
        ),
    )
    decode = Engine(
        model,
        EngineSpec(
            "decode-engine",
            DECODE_TP,
            DECODE_BLOCK,
            "kv_consumer",
            48,
            "LBHNC",
            {**common, "fetch_timeout_s": 5, "handshake_timeout_s": 2},
        ),
    )
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield prefill, decode, port
    finally:
        decode.close()
        prefill.close()


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


def _remote_params(engine_id: str, request_id: str, port: int, num_tokens: int) -> dict:
    """What a prefill engine's `request_finished` returns, for a request it may not hold."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "remote_block_ids": [],
        "remote_num_tokens": num_tokens,
        "tp_size": PREFILL_TP,
    }


def _run_until(condition, engines, timeout: float = 90.0, on_step=None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("the engines did not reach the expected state in time")
        for engine in engines:
            outputs = engine.step()
            if on_step is not None:
                on_step(engine, outputs)
        time.sleep(0.02)


def test_pd_flow_moves_kv_bit_exact_and_frees_blocks(engines):
    prefill, decode, port = engines
    prompts = {"req-a": _prompt(1, 45), "req-b": _prompt(2, 100), "req-c": _prompt(3, 17)}
    for request_id, prompt in prompts.items():
        prefill.add(request_id, prompt, max_tokens=1, params={"do_remote_decode": True})

    # Prefill: vLLM finishes each request after one token and hands back kvxfer's params.
    params: dict[str, dict] = {}

    def collect(engine, outputs):
        for o in outputs:
            if engine is prefill and o.finish_reason is not None:
                params[o.request_id] = o.kv_transfer_params

    _run_until(lambda: len(params) == len(prompts), [prefill], on_step=collect)
    for request_id, prompt in prompts.items():
        p = params[request_id]
        assert p["do_remote_prefill"] is True and p["do_remote_decode"] is False
        assert p["remote_engine_id"] == "prefill-engine"
        assert p["remote_request_id"] == request_id
        assert (p["remote_host"], p["remote_port"]) == ("127.0.0.1", port)
        assert p["tp_size"] == PREFILL_TP
        assert p["remote_num_tokens"] == len(prompt)
        assert len(p["remote_block_ids"]) == -(-len(prompt) // 16)
    # Delayed free: the prefill engine still holds every prompt's blocks.
    assert prefill.free_blocks() == prefill.free_blocks_at_start - sum(
        len(p["remote_block_ids"]) for p in params.values()
    )

    # Decode: the proxy forwards each request with the prefill's params.
    for request_id, prompt in prompts.items():
        decode.add(request_id, prompt, max_tokens=3, params=params[request_id])
    generated: dict[str, list[int]] = {r: [] for r in prompts}
    finished: set[str] = set()
    checked: dict[str, list[list[int]]] = {}
    first_compute: dict[str, int] = {}

    def follow(engine, outputs):
        if engine is not decode:
            return
        for request_id, count in engine.last_scheduled.items():
            first_compute.setdefault(request_id, count)
        for o in outputs:
            generated[o.request_id] += o.new_token_ids
            if o.finish_reason is not None:
                finished.add(o.request_id)
        # Check a request's KV on every decode rank as soon as vLLM learns its load finished,
        # before the decode engine computes anything for it.
        for request_id in decode.finished_recving - set(checked):
            block_ids = decode.scheduler.kv_cache_manager.get_block_ids(request_id)[0]
            prompt = prompts[request_id]
            checked[request_id] = decode.check(prompt, list(block_ids), len(prompt))

    _run_until(
        lambda: finished == set(prompts) and prefill.finished_sending >= set(prompts),
        [decode, prefill],
        on_step=follow,
    )
    assert checked == {r: [[]] * DECODE_TP for r in prompts}, "KV differs on a decode rank"
    assert decode.invalid_block_ids == []
    # Admission after the load: only the last prompt token is recomputed locally.
    assert first_compute == {r: 1 for r in prompts}
    assert all(len(tokens) == 3 for tokens in generated.values()), generated
    # Blocks come back on both sides once the request is done everywhere.
    assert prefill.free_blocks() == prefill.free_blocks_at_start
    assert decode.free_blocks() == decode.free_blocks_at_start
    totals = {k: sum(s[k] for s in decode.stats) for k in ("transfers", "failures", "bytes")}
    # One load per request on each decode rank; together they move every head of every layer.
    assert totals == {
        "transfers": len(prompts) * DECODE_TP,
        "failures": 0,
        "bytes": sum(len(p) for p in prompts.values()) * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2,
    }


def test_failed_load_reports_exactly_its_blocks_and_vllm_recomputes(engines):
    _, decode, port = engines
    finished: set[str] = set()
    first_compute: dict[str, int] = {}

    def follow(engine, outputs):
        for request_id, count in engine.last_scheduled.items():
            first_compute.setdefault(request_id, count)
        finished.update(o.request_id for o in outputs if o.finish_reason is not None)

    # A request computed on the decode engine itself leaves two full blocks in its prefix cache.
    shared = _prompt(5, 2 * DECODE_BLOCK)
    decode.add("req-local", [*shared, *_prompt(6, 10)], max_tokens=1, params=None)
    _run_until(lambda: "req-local" in finished, [decode], on_step=follow)

    # A remote prefill of a prompt that starts with those blocks, whose KV never arrives.
    prompt = [*shared, *_prompt(7, 6)]
    # The prefill engine is up but never published this request (lost it).
    lost = _remote_params("prefill-engine", "never-published", port, len(prompt))
    decode.add("req-lost", prompt, max_tokens=2, params=lost)
    errors_before = len(decode.invalid_block_ids)
    decode.step()  # allocates the blocks and starts loading the tokens past the local hit
    load_blocks = list(decode.scheduler.kv_cache_manager.get_block_ids("req-lost")[0])
    _run_until(lambda: "req-lost" in decode.finished_recving, [decode], timeout=30)
    # Each decode rank reports its failed blocks; vLLM sees exactly the block the load was to
    # fill (tokens 64-69), not the two blocks its own prefix cache supplied.
    reported = decode.invalid_block_ids[errors_before:]
    assert reported and set().union(*reported) == {load_blocks[2]}

    _run_until(lambda: "req-lost" in finished, [decode], on_step=follow)
    assert first_compute["req-lost"] == len(prompt) - 2 * DECODE_BLOCK, "recompute the tail only"
    assert decode.free_blocks() == decode.free_blocks_at_start


def test_unreachable_prefill_engine_fails_every_block_of_the_load(engines):
    _, decode, _ = engines
    prompt = _prompt(8, 40)
    # Nothing listens where this engine is said to be.
    nowhere = _remote_params("gone-engine", "req-x", free_port_base(PREFILL_TP), len(prompt))
    decode.add("req-nowhere", prompt, max_tokens=1, params=nowhere)
    errors_before = len(decode.invalid_block_ids)
    decode.step()
    load_blocks = list(decode.scheduler.kv_cache_manager.get_block_ids("req-nowhere")[0])
    _run_until(lambda: "req-nowhere" in decode.finished_recving, [decode], timeout=30)
    reported = decode.invalid_block_ids[errors_before:]
    assert reported and set().union(*reported) == set(load_blocks[:2])  # 40 tokens, blocks of 32
    finished: set[str] = set()
    _run_until(
        lambda: "req-nowhere" in finished,
        [decode],
        on_step=lambda _, outs: finished.update(
            o.request_id for o in outs if o.finish_reason is not None
        ),
    )
    assert decode.free_blocks() == decode.free_blocks_at_start
