"""vLLM's hybrid memory allocator under vLLM's Scheduler, prefill TP 2 (blocks of 16, LBNHC) ->
decode TP 3 (blocks of 32, LBHNC), each engine's KV cache groups overlaying one allocation as
vLLM lays them out; vLLM calls the connector's `request_finished_all_groups`.

- Full attention (even layers) and a sliding window of 24 tokens (odd layers): vLLM gives the
  window group its null block for the blocks it dropped. The full group must hold every prompt
  token, the window group every token the next query attends to; the bytes moved are exactly
  those; the null block is never written.
- Full attention and Mamba2 (odd layers; conv state `x, B, C` and SSM heads resharded from 2 to
  3 ranks): the prefill computes all but the last prompt token, the decode loads that many
  tokens and every layer's state after them, then computes only the last token.

Every decode rank is checked bit for bit before it computes anything; blocks come back on both
sides. Runs in the vLLM environment (`make test-vllm`)."""

from __future__ import annotations

import os

import pytest
from pd_engines import (
    HEAD_DIM,
    KV_HEADS,
    MODEL,
    Engine,
    EngineSpec,
    load_and_check,
    prefill_remote,
    random_prompt,
    run_until,
    running,
    write_model,
)

LAYERS, WINDOW = 4, 24  # layers 0 and 2: full attention; 1 and 3: a window of 24 tokens
HYBRID_MODEL = {**MODEL, "num_hidden_layers": LAYERS}
COMMON = {"cost_model": "tcp_loopback", "secret": "s3cret"}
DECODE_EXTRA = {**COMMON, "fetch_timeout_s": 20, "handshake_timeout_s": 5}
DECODE_TP = 3


def _engines(model: str, name: str, **kind) -> list[Engine]:
    return [
        Engine(
            model, EngineSpec(f"prefill-{name}", 2, 16, "kv_producer", 64, "LBNHC", COMMON, **kind)
        ),
        Engine(
            model,
            EngineSpec(
                f"decode-{name}", DECODE_TP, 32, "kv_consumer", 48, "LBHNC", DECODE_EXTRA, **kind
            ),
        ),
    ]


@pytest.fixture(scope="module")
def window_engines(tmp_path_factory):
    model = write_model(tmp_path_factory.mktemp("model"), HYBRID_MODEL)
    with running(_engines(model, "window", sliding_window=WINDOW)) as engines:
        yield engines


@pytest.fixture(scope="module")
def mamba_engines(tmp_path_factory):
    """The conv state stored channels first (VLLM_SSM_CONV_STATE_LAYOUT=DS, which both engines'
    processes inherit)."""
    model = write_model(tmp_path_factory.mktemp("mamba-model"), HYBRID_MODEL)
    before = os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT")
    os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = "DS"
    try:
        with running(_engines(model, "mamba", mamba=True)) as engines:
            yield engines
    finally:
        if before is None:
            os.environ.pop("VLLM_SSM_CONV_STATE_LAYOUT", None)
        else:
            os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = before


def _prefill(prefill: Engine, prompts: dict[str, list[int]]) -> dict[str, dict]:
    """Prefill prompts for remote decode; their kv_transfer_params, one table per group."""
    params = prefill_remote(prefill, prompts, timeout=90.0)
    for handed in params.values():
        assert len(handed["remote_block_ids"]) == 2, "one block table per KV cache group"
    return params


def _decode(prefill: Engine, decode: Engine, prompts, params, loaded, on_loaded=None) -> None:
    """Load every request on the decode engine; as soon as vLLM learns a load finished (before
    any decode compute), check its first `loaded(prompt)` tokens on every decode rank; finish
    the requests. Then: no load error, only the last prompt token computed, every block back."""
    loads = {r: (prompt, params[r]) for r, prompt in prompts.items()}
    seen = load_and_check(decode, [prefill], loads, 90.0, loaded, on_loaded)
    assert seen.checked == {r: [[]] * DECODE_TP for r in prompts}, "KV differs on a decode rank"
    assert decode.invalid_block_ids == []
    assert seen.first_compute == {r: 1 for r in prompts}, "only the last prompt token is computed"
    assert prefill.free_blocks() == prefill.free_blocks_at_start
    assert decode.free_blocks() == decode.free_blocks_at_start


def _kept_from(num_tokens: int) -> int:
    """vLLM's sliding-window manager keeps blocks from this token's on
    (`get_num_skipped_tokens` of the loaded count)."""
    return max(0, num_tokens - WINDOW + 1)


def _moved_from(num_tokens: int, block_size: int = 32) -> int:
    """The first token the window group moves: the first the recomputed last prompt token
    attends to (vLLM recomputes it after loading the whole prompt), unless vLLM already
    dropped its block (then from the first block it keeps)."""
    kept_block = _kept_from(num_tokens) // block_size * block_size
    return max(0, num_tokens - WINDOW, kept_block)


def test_full_and_sliding_window_groups_move_bit_exact(window_engines):
    prefill, decode = window_engines
    prompts = {
        "hyb-a": random_prompt(11, 100),
        "hyb-b": random_prompt(12, 45),
        "hyb-c": random_prompt(13, 17),  # shorter than the window: every token moves
        # The recomputed last token attends to token 63, whose block vLLM dropped (it keeps
        # blocks from token 64's): kvxfer moves from 64 and never writes the null block.
        "hyb-d": random_prompt(14, 87),
    }
    params = _prefill(prefill, prompts)
    for request_id, prompt in prompts.items():
        assert all(len(t) == -(-len(prompt) // 16) for t in params[request_id]["remote_block_ids"])

    def dropped_blocks_are_null(prompt, tables):
        dropped = _kept_from(len(prompt)) // 32
        assert all(b == 0 for b in tables[1][:dropped]), "vLLM nulls dropped blocks"

    _decode(prefill, decode, prompts, params, len, dropped_blocks_are_null)
    assert decode.null_block_untouched() == [True] * DECODE_TP, "a dropped block was written"
    # Exactly the full group's tokens and the window group's window crossed the wire.
    cell = 2 * KV_HEADS * HEAD_DIM * 2  # both planes of every head (over the 3 ranks), bf16
    per_layer_pair = sum(2 * len(p) - _moved_from(len(p)) for p in prompts.values())
    moved = sum(s["bytes"] for s in decode.stats)
    assert moved == per_layer_pair * (LAYERS // 2) * cell


def test_a_failed_load_fails_its_request_whole_and_vllm_recomputes_it(window_engines):
    # vLLM maps failed block ids back to requests only for one KV cache group (its scheduler
    # raises for several): each decode rank reports the request in `failed_recving` instead.
    prefill, decode = window_engines
    prompt = random_prompt(31, 70)
    params = _prefill(prefill, {"hyb-real": prompt})["hyb-real"]
    # The same prefill engine, up and serving, but it never published this request: the
    # fetch fails at the decode's fetch_timeout_s. (Copied before vLLM's load of the real
    # request marks its parameters used.)
    lost = {**params, "remote_request_id": "never-published"}
    _decode(prefill, decode, {"hyb-real": prompt}, {"hyb-real": params}, len)
    first_compute: dict[str, int] = {}
    finished: set[str] = set()

    def follow(engine, outputs):
        for request_id, count in engine.last_scheduled.items():
            first_compute.setdefault(request_id, count)
        finished.update(o.request_id for o in outputs if o.finish_reason is not None)

    other = random_prompt(32, len(prompt))  # no prefix of it is cached on the decode
    decode.add("hyb-lost", other, max_tokens=1, params=lost)
    run_until(lambda: "hyb-lost" in decode.finished_recving, [decode], 90.0, on_step=follow)
    assert "hyb-lost" in decode.failed_recving and decode.invalid_block_ids == []
    run_until(lambda: "hyb-lost" in finished, [decode], 90.0, on_step=follow)
    assert first_compute["hyb-lost"] == len(other), "vLLM recomputes the whole prompt"
    assert decode.free_blocks() == decode.free_blocks_at_start


def test_mamba_state_is_resharded_and_the_last_token_recomputed(mamba_engines):
    prefill, decode = mamba_engines
    prompts = {"mam-a": random_prompt(21, 70), "mam-b": random_prompt(22, 9)}
    params = _prefill(prefill, prompts)
    for request_id, prompt in prompts.items():
        # The prefill computed N - 1 tokens: its state is the one the decode continues from.
        assert params[request_id]["remote_num_tokens"] == len(prompt) - 1
    # Attention KV of N - 1 tokens and every layer's state after them, on every rank.
    _decode(prefill, decode, prompts, params, lambda prompt: len(prompt) - 1)
