"""The checks every real-engine P/D case makes, shared by the e2e modules.

A case sends prompts through a pair's front (kvxfer's proxy, or a router) and checks four
things: the greedy token ids equal one engine's alone; the decode engine's
`prompt_tokens_by_source{external_kv_transfer}` grew by the prompt tokens it loaded; kvxfer
counted no failed load; both engines end with no request running and no block held.
Prompts are token ids of chosen lengths, greedy, `ignore_eos`, so every output has
`MAX_TOKENS` tokens.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from conftest import Pair, observe

from kvxfer.testing import vllm_driver as driver
from kvxfer.testing.tiny_model import SPECIAL_TOKENS
from kvxfer.testing.vllm_cpu_engines import MODEL_NAME, Server

MAX_TOKENS = 32
REQUEST_FIELDS = {"ignore_eos": True}
REQUEST_TIMEOUT = 300.0
METRIC_TIMEOUT = 30.0
KVXFER_FAILED = "vllm:kvxfer_failed_transfers"
KVXFER_TRANSFERS = "vllm:kvxfer_transfers"
KVXFER_STREAMED = "vllm:kvxfer_streamed_requests"
KVXFER_BYTES = "vllm:kvxfer_transferred_bytes"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
GENERATED = "vllm:generation_tokens"
PREEMPTIONS = "vllm:num_preemptions"
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source"
LOCAL_CACHE_HIT = 'source="local_cache_hit"'
# Requests vLLM holds back, by reason: "deferred" counts those waiting for their KV transfer.
WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
# How long a pair may take to free its blocks once a case's answers are in: a hang guard (the
# prefill frees a request's blocks when every decode rank has reported its load done).
IDLE_TIMEOUT = 120.0


def prompt_ids(length: int, vocab: int, salt: str = "") -> list[int]:
    """A deterministic prompt of `length` token ids, none of them a special token."""
    rng = random.Random(f"kvxfer-e2e-{length}-{salt}")
    return [rng.randrange(len(SPECIAL_TOKENS), vocab) for _ in range(length)]


def external_tokens(prompt_tokens: int) -> int:
    """What vLLM 0.32 adds to `prompt_tokens_by_source{source="external_kv_transfer"}` for a
    prompt whose KV is loaded: every prompt token, except for a 1-token prompt, which it counts
    as computed locally (measured: kvxfer still loads it, once per decode rank)."""
    return prompt_tokens if prompt_tokens > 1 else 0


def one_prompt(result: dict[str, Any], index: int) -> dict[str, Any]:
    """The driver's `collect` result reduced to its prompt `index` (to compare one case)."""
    return {
        **result,
        "prompts": [result["prompts"][index]],
        "outputs": [result["outputs"][index]],
    }


def collect(
    url: str, prompts: list[list[int]], concurrency: int = 1, max_tokens: int = MAX_TOKENS
) -> dict[str, Any]:
    """The driver's greedy completions with this suite's settings."""
    return driver.collect(
        url,
        MODEL_NAME,
        prompts=prompts,
        max_tokens=max_tokens,
        timeout=REQUEST_TIMEOUT,
        concurrency=concurrency,
        extra=REQUEST_FIELDS,
    )


class Counters:
    """The decode engine's transfer counters before a request, to read what it added."""

    def __init__(self, decode: Server) -> None:
        self.decode = decode
        self.loaded = decode.metric(driver.TRANSFER_METRIC, driver.TRANSFER_SOURCE)
        self.local_hits = decode.metric(PROMPT_TOKENS_BY_SOURCE, LOCAL_CACHE_HIT)
        self.transfers = decode.metric(KVXFER_TRANSFERS)
        self.failed = decode.metric(KVXFER_FAILED)
        self.bytes = decode.metric(KVXFER_BYTES)

    def loaded_since(self, expected: float) -> float:
        """Prompt tokens loaded through the connector since, once at least `expected` (vLLM
        updates its metrics from the scheduler's stats, which may trail the answer); what was
        loaded when the deadline passes otherwise."""
        return once_at_least(self._loaded, expected, "the external_kv_transfer counter")

    def local_hits_since(self) -> float:
        """Prompt tokens the decode engine found in its own prefix cache since."""
        return self.decode.metric(PROMPT_TOKENS_BY_SOURCE, LOCAL_CACHE_HIT) - self.local_hits

    def transfers_since(self) -> float:
        """kvxfer's finished loads since (one per decode rank and request)."""
        return self.decode.metric(KVXFER_TRANSFERS) - self.transfers

    def transfers_at_least(self, count: int) -> float:
        """kvxfer's finished loads since, once at least `count`; what there are after the
        deadline otherwise."""
        return once_at_least(self.transfers_since, count, "kvxfer's transfer counter")

    def failed_since(self) -> float:
        """kvxfer's loads with blocks to recompute since."""
        return self.decode.metric(KVXFER_FAILED) - self.failed

    def bytes_since(self) -> float:
        """Bytes kvxfer's ok loads moved since (every decode rank's)."""
        return self.decode.metric(KVXFER_BYTES) - self.bytes

    def _loaded(self) -> float:
        return self.decode.metric(driver.TRANSFER_METRIC, driver.TRANSFER_SOURCE) - self.loaded


def once_at_least(read: Callable[[], float], expected: float, what: str) -> float:
    """`read()` once it reaches `expected` (metrics trail the answers), or its value when
    `METRIC_TIMEOUT` passes first: the caller's assertion then says what it was."""
    try:
        return driver.wait_until(
            lambda: value if (value := read()) >= expected else None,
            timeout=METRIC_TIMEOUT,
            what=what,
        )
    except driver.E2EError:
        return read()


def idle(engine: Server, idle_usage: float = 0.0) -> bool:
    """No request running or waiting, and the KV cache as used as when idle."""
    return (
        engine.metric(RUNNING) == 0
        and engine.metric(WAITING) == 0
        and engine.metric(KV_USAGE) <= idle_usage
    )


def wait_idle(engines: Sequence[Server]) -> None:
    """Wait until every engine holds no request and no block (vLLM counts blocks that only its
    prefix cache keeps as free).

    Raises:
        driver.E2EError: an engine still held a request or blocks after `IDLE_TIMEOUT`.
    """
    for engine in engines:
        driver.wait_until(
            lambda engine=engine: idle(engine) or None,
            timeout=IDLE_TIMEOUT,
            what=f"{engine.name}: no request running or waiting and every block free",
        )


def check_prompt(
    pair: Pair,
    expected: dict[str, Any],
    case: str,
    via: Server | None = None,
    concurrent: bool = False,
    loads: int | None = None,
    compare_tokens: bool = True,
) -> dict[str, Any]:
    """One prompt through the pair's proxy (or the front `via`): `expected` (the baseline's
    `collect` result for that one prompt) gives its token ids (only reported where not
    `compare_tokens`), the decode engine loaded `loads` of its tokens through kvxfer
    (default: the whole prompt) with no failed load, and both engines end idle.
    `concurrent` (a front sending both engines the request at once): the prefill engine
    streamed it (offered it as scheduled, layer by layer, chunk by chunk); otherwise it
    offered it when finished. Returns the case's observation (also recorded)."""
    prompt = expected["prompts"][0]
    loads = external_tokens(len(prompt)) if loads is None else loads
    counters = Counters(pair.decode)
    streamed_before = pair.prefill.metric(KVXFER_STREAMED)
    started = time.monotonic()
    result = collect((via or pair.proxy).url, [prompt])
    seconds = time.monotonic() - started
    # kvxfer's loads first: a 1-token prompt's expected count (0) cannot be waited for.
    transfers = counters.transfers_at_least(pair.decode_tp)
    loaded = counters.loaded_since(loads)
    streamed = once_at_least(
        lambda: pair.prefill.metric(KVXFER_STREAMED) - streamed_before,
        1 if concurrent else 0,
        "kvxfer's streamed-request counter",
    )
    comparison = driver.compare(expected, result, require_transfer=False)
    wait_idle([pair.prefill, pair.decode])
    mismatch = comparison.report["mismatches"][0] if comparison.report["mismatches"] else None
    observation = {
        "pair": pair.label,
        "front": (via or pair.proxy).name,
        "case": case,
        "same_tokens": comparison.ok,
        "first_different_token": mismatch and mismatch["first_different_token"],
        "external_kv_tokens": loaded,
        "decode_local_hits": counters.local_hits_since(),
        "kvxfer_transfers": transfers,
        "kvxfer_bytes": counters.bytes_since(),
        "kvxfer_failed": counters.failed_since(),
        "prefill_streamed": streamed,
        "seconds": round(seconds, 1),
    }
    observe(**observation)
    # Each message carries the whole observation: CI shows the failure, not the summary.
    seen = json.dumps(observation)
    assert loaded == loads, f"the decode engine loaded {loaded} tokens, not {loads}: {seen}"
    assert transfers == pair.decode_tp, f"one finished kvxfer load per decode rank: {seen}"
    assert counters.failed_since() == 0, f"a kvxfer load failed (recomputed): {seen}"
    assert (streamed >= 1) == concurrent, f"prefill streamed {streamed} times ({concurrent=})"
    assert comparison.ok or not compare_tokens, "\n".join(comparison.problems)
    return observation


def check_in_flight(
    pair: Pair,
    baseline: Server,
    prompts: list[list[int]],
    case: str,
    max_tokens: int = MAX_TOKENS,
    compare_tokens: bool = True,
    loads: Callable[[int], int] = external_tokens,
) -> None:
    """`prompts` in flight at once through the pair's proxy (a thread each), `max_tokens`
    generated each (token matches only reported where not `compare_tokens`); the decode
    engine loads `loads(prompt tokens)` of each prompt.

    Greedy outputs may depend on the batch a request shares (other kernels, other reduction
    orders), and which requests share a step differs between the baseline and the decode
    engine (arrivals are staggered by the prefill). So: the baseline answers the same prompts
    one at a time and all at once; a prompt whose two baseline outputs agree is
    batch-invariant here, and its disaggregated output must equal them. A prompt whose
    baseline output changes with batching is only reported (its tokens are not compared): no
    single reference is right for it. The decode engine must have loaded every prompt's KV,
    with no failed load, every request must succeed, and both engines end idle.
    """
    sequential = collect(baseline.url, prompts, max_tokens=max_tokens)
    batched = collect(baseline.url, prompts, concurrency=len(prompts), max_tokens=max_tokens)
    counters = Counters(pair.decode)
    disaggregated = collect(
        pair.proxy.url, prompts, concurrency=len(prompts), max_tokens=max_tokens
    )
    expected_tokens = sum(loads(len(p)) for p in prompts)
    loaded = counters.loaded_since(expected_tokens)
    wait_idle([pair.prefill, pair.decode])
    invariant = [
        i
        for i in range(len(prompts))
        if sequential["outputs"][i]["token_ids"] == batched["outputs"][i]["token_ids"]
    ]
    same = [
        i
        for i in invariant
        if disaggregated["outputs"][i]["token_ids"] == sequential["outputs"][i]["token_ids"]
    ]
    differ = [
        problem
        for i in sorted(set(invariant) - set(same))
        for problem in driver.compare(
            one_prompt(sequential, i), one_prompt(disaggregated, i), require_transfer=False
        ).problems
    ]
    observe(
        pair=pair.label,
        case=case,
        batch_invariant_prompts=len(invariant),
        same_tokens=f"{len(same)}/{len(invariant)}",
        external_kv_tokens=loaded,
        kvxfer_failed=counters.failed_since(),
        differences=differ,
    )
    assert loaded == expected_tokens
    assert counters.failed_since() == 0
    if compare_tokens:
        assert invariant, "batching changed every baseline output: nothing to compare"
        assert same == invariant, "\n".join(differ)
