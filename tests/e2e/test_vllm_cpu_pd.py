"""Real `vllm serve` engines (vLLM's CPU build) through kvxfer: prefill -> decode behind kvxfer's
P/D proxy gives the greedy token ids of one engine alone.

The prompts, requests, comparison and report are the shared driver's
(`kvxfer/testing/vllm_driver.py`, which `scripts/gpu_vllm_e2e.sh` uses on a GPU). Prompts are token
ids of chosen lengths (the tiny model's tokenizer makes exact lengths awkward as text), greedy,
`ignore_eos`, so every output has `MAX_TOKENS` tokens. Engines start once per class (module
start-up is ~65 s per engine on 2 cores), the baseline once per session.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import http.client
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Pair, observe, start_pair
from pd_checks import (
    GENERATED,
    KV_USAGE,
    MAX_TOKENS,
    METRIC_TIMEOUT,
    REQUEST_FIELDS,
    REQUEST_TIMEOUT,
    WAITING_BY_REASON,
    Counters,
    check_in_flight,
    check_prompt,
    collect,
    idle,
    once_at_least,
    one_prompt,
    prompt_ids,
)

from kvxfer.connector.timeline import PHASES
from kvxfer.integrations.pd_proxy import decode_body, prefill_body
from kvxfer.testing import vllm_driver as driver
from kvxfer.testing.vllm_cpu_engines import (
    MAX_MODEL_LEN,
    MAX_NUM_BATCHED_TOKENS,
    MODEL_NAME,
    Processes,
    Server,
)

# The abandoned request's prompt, and the most tokens it may ask for: all the model's length
# allows (about 25 s of decoding at the 300 tokens/s measured in CI), so that it is still running
# when its client walks away, however late a loaded machine lets the client read its stream.
ABANDONED_PROMPT_TOKENS = 300
ABANDONED_MAX_TOKENS = MAX_MODEL_LEN - ABANDONED_PROMPT_TOKENS - 8


@dataclasses.dataclass(frozen=True)
class Case:
    """One prompt length, named for where it falls against the block sizes (32 and 64) and
    the prefill's chunk budget."""

    name: str
    length: int


CASES = (
    Case("1-token", 1),
    Case("20-tokens-under-a-block", 20),
    Case("32-tokens-one-block-of-32", 32),
    Case("64-tokens-one-block-of-64", 64),
    Case("209-tokens-3-blocks-and-a-part", 3 * 64 + 17),
    Case("700-tokens-over-the-chunk-budget", 700),
    Case("4000-tokens", 4000),
)
assert CASES[-2].length > MAX_NUM_BATCHED_TOKENS
# The concurrency test's prompts: 8 lengths, none a multiple of either block size.
CONCURRENT_LENGTHS = (33, 70, 101, 150, 257, 300, 411, 590)


@pytest.fixture(scope="session")
def case_prompts(vocab: int) -> list[list[int]]:
    """The prompt of every case, in CASES' order."""
    return [prompt_ids(case.length, vocab) for case in CASES]


@pytest.fixture(scope="session")
def baseline_outputs(baseline: Server, case_prompts: list[list[int]]) -> dict[str, Any]:
    """One engine alone: every case's greedy output, one request at a time."""
    started = time.monotonic()
    result = collect(baseline.url, case_prompts)
    observe(event="baseline outputs", seconds=round(time.monotonic() - started, 1))
    return result


def check_case(
    pair: Pair,
    baseline: dict[str, Any],
    prompts: list[list[int]],
    case: Case,
    via: Server | None = None,
    concurrent: bool = False,
) -> None:
    """One case of `CASES` through the pair's proxy or the front `via` (`check_prompt`)."""
    index = CASES.index(case)
    check_prompt(pair, one_prompt(baseline, index), case.name, via, concurrent)


@pytest.fixture(scope="class")
def pair(
    request: pytest.FixtureRequest,
    processes: Processes,
    tiny_model: Path,
    secret: str,
    baseline_started: tuple[Server, float],
) -> Iterator[Pair]:
    """The class's prefill and decode engines behind a proxy, started once for the class (with
    the baseline, on the first class) and stopped after it: its `GEOMETRY` is ((prefill TP
    size, block size), (decode TP size, block size)); its `SPARE_PREFILL`, if any, the geometry
    of a prefill engine started with them for a test of its own."""
    (prefill, decode) = request.cls.GEOMETRY
    label = f"tp{prefill[0]}b{prefill[1]}-tp{decode[0]}b{decode[1]}"
    spare = getattr(request.cls, "SPARE_PREFILL", None)
    engines = start_pair(
        processes, tiny_model, secret, label=label, prefill=prefill, decode=decode, spare=spare
    )
    yield engines
    processes.stop(engines.servers())


class GreedyCases:
    """Every case of `CASES` through a class's pair (its `GEOMETRY`: see `pair`)."""

    @pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
    def test_greedy_tokens_equal_one_engine_alone(
        self,
        pair: Pair,
        baseline_outputs: dict[str, Any],
        case_prompts: list[list[int]],
        case: Case,
    ) -> None:
        """Each prompt length gives the baseline's token ids, its KV loaded through kvxfer."""
        check_case(pair, baseline_outputs, case_prompts, case)


# What the routers' tests send: under a block, blocks and a part, over the chunk budget.
ROUTED_CASES = tuple(c for c in CASES if c.length in (20, 3 * 64 + 17, 700))
# Fronts other than the pair's own proxy (sequential flow), started in front of a pair; those
# that speak the concurrent flow (the decode engine sent the request with a transfer id:
# kvxfer's proxy sends both engines the request at once, vllm-router once the prefill answered).
CONCURRENT_FRONTS = ("vllm-router-mooncake", "proxy-concurrent")
FRONTS: dict[str, Callable[[Processes, Pair], Server]] = {
    "vllm-router-nixl": lambda processes, pair: processes.start_router(
        pair.prefill, pair.bootstrap_port, pair.decode, "nixl"
    ),
    "vllm-router-mooncake": lambda processes, pair: processes.start_router(
        pair.prefill, pair.bootstrap_port, pair.decode, "mooncake"
    ),
    "proxy-concurrent": lambda processes, pair: processes.start_proxy(
        pair.prefill, pair.decode, REQUEST_TIMEOUT, bootstrap_port=pair.bootstrap_port
    ),
}


class TestPrefillTp1Block32ToDecodeTp2Block64(GreedyCases):
    """Prefill TP 1 with blocks of 32 -> decode TP 2 with blocks of 64; then vLLM's own router
    in front of the same engines, in both of its P/D modes."""

    GEOMETRY = ((1, 32), (2, 64))

    @pytest.mark.parametrize("front", list(FRONTS))
    def test_routers_drive_kvxfer_unchanged(
        self,
        pair: Pair,
        processes: Processes,
        baseline_outputs: dict[str, Any],
        case_prompts: list[list[int]],
        front: str,
    ) -> None:
        """The same engines behind another front (`FRONTS`): `vllm-router` in its default mode
        (the prefill request first, then the decode request with the prefill's parameters:
        kvxfer's sequential flow) and in its mooncake mode (the decode request with a
        `transfer_id` it mints, the prefill's engine id read from kvxfer's bootstrap `/query`:
        the concurrent flow), and kvxfer's proxy in its concurrent flow: the baseline's token
        ids, every prompt's KV loaded through kvxfer, no failed load."""
        entry = FRONTS[front](processes, pair)
        concurrent = front in CONCURRENT_FRONTS
        try:
            for case in ROUTED_CASES:
                check_case(pair, baseline_outputs, case_prompts, case, entry, concurrent)
        finally:
            processes.stop([entry])

    def test_every_loaded_request_is_timed_phase_by_phase(
        self,
        pair: Pair,
        baseline_outputs: dict[str, Any],
        case_prompts: list[list[int]],
    ) -> None:
        """The decode engine's `/metrics` counts each loaded request once in every phase of
        its timeline (`kvxfer.connector.timeline.PHASES`: the prefill's events came with its
        chunks, both decode ranks' with their stats), with kvxfer's share under the whole."""

        def phase(name: str, part: str = "count") -> float:
            metric = f"vllm:kvxfer_request_phase_seconds_{part}"
            return pair.decode.metric(metric, f'phase="{name}"')

        before = {name: phase(name) for name in PHASES}
        total_before, share_before = phase("total", "sum"), phase("kvxfer", "sum")
        for case in ROUTED_CASES:
            check_case(pair, baseline_outputs, case_prompts, case)
        loaded = len(ROUTED_CASES)
        once_at_least(lambda: phase("total") - before["total"], loaded, "the phases' counts")
        counted = {name: phase(name) - before[name] for name in PHASES}
        assert counted == dict.fromkeys(PHASES, float(loaded)), counted
        total, share = phase("total", "sum") - total_before, phase("kvxfer", "sum") - share_before
        observe(case="timeline", requests=loaded, total_s=round(total, 3), kvxfer_s=round(share, 3))
        assert 0 < share < total


def stream_until_running(proxy: Server, prompt: list[int]) -> int:
    """Start a long streamed completion through the proxy, read until the decode engine has
    streamed tokens (the proxy's prefill request streams none: the events are the decode
    engine's, so it runs the request), then close the connection (a client that walks away);
    the number of bytes read."""
    host, port = proxy.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=REQUEST_TIMEOUT)
    body = driver.completion_request(
        prompt,
        MODEL_NAME,
        max_tokens=ABANDONED_MAX_TOKENS,
        seed=0,
        extra={**REQUEST_FIELDS, "stream": True},
    )
    try:
        connection.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        assert response.status == 200, response.read()[:2000]
        received = b""
        while received.count(b"data:") < 3:
            chunk = response.read1(4096)
            assert chunk, "the stream ended before three chunks"
            received += chunk
        return len(received)
    finally:
        connection.close()


class TestPrefillTp2Block64ToDecodeTp1Block32(GreedyCases):
    """Prefill TP 2 with blocks of 64 -> decode TP 1 with blocks of 32; then concurrency, a
    client that walks away mid-stream or during a first connect, and a prefill engine killed
    while its transfer is held open."""

    GEOMETRY = ((2, 64), (1, 32))
    SPARE_PREFILL = (1, 64)  # the prefill engine of the abort-while-connecting and kill tests

    def test_eight_requests_in_flight_at_once(
        self, pair: Pair, baseline: Server, vocab: int
    ) -> None:
        """8 requests in flight at once through the proxy (`check_in_flight`)."""
        prompts = [prompt_ids(n, vocab, salt="concurrent") for n in CONCURRENT_LENGTHS]
        check_in_flight(pair, baseline, prompts, "8-in-flight")

    def test_an_abandoned_request_frees_its_blocks_on_both_engines(
        self, pair: Pair, vocab: int
    ) -> None:
        """A client closes its connection while the decode engine streams: the proxy's write
        fails, it closes its decode connection, vLLM aborts the request; both engines end with
        no request running and their KV caches as used as before (the prefill's blocks are
        released once the decode engine has loaded them)."""
        engines = (pair.prefill, pair.decode)
        usage_before = {e.name: e.metric(KV_USAGE) for e in engines}
        generated_before = pair.decode.metric(GENERATED)
        started = time.monotonic()
        prompt = prompt_ids(ABANDONED_PROMPT_TOKENS, vocab, "gone")
        received = stream_until_running(pair.proxy, prompt)
        for engine in engines:
            driver.wait_until(
                functools.partial(idle, engine, usage_before[engine.name]),
                timeout=120.0,
                what=f"{engine.name}: no request running and its blocks freed",
            )
        generated = pair.decode.metric(GENERATED) - generated_before
        observe(
            pair=pair.label,
            case="abandoned-stream",
            bytes_streamed=received,
            tokens_generated=generated,
            seconds_until_freed=round(time.monotonic() - started, 1),
        )
        assert generated < ABANDONED_MAX_TOKENS, "the request ran to its end: it was not aborted"

    def test_an_abort_during_the_first_connect_frees_the_prefill_at_once(
        self, pair: Pair, processes: Processes, vocab: int
    ) -> None:
        """The decode engine's first connect to a prefill engine (the class's spare, never
        used before) is held open: the spare is frozen (SIGSTOP), so no handshake answers.
        The client walks away meanwhile; vLLM aborts the request and the decode engine, with
        nothing left to run, steps no more. Once the spare runs again, the abort notice goes
        out from the connect itself: the spare frees the request's blocks at once, long before
        its `request_timeout_s` (120 s), which is when it would free them otherwise."""
        assert pair.spare is not None
        spare = pair.spare
        processes.wait_ready([spare])
        idle_usage = {e.name: e.metric(KV_USAGE) for e in (spare, pair.decode)}
        request = driver.completion_request(
            prompt_ids(ABANDONED_PROMPT_TOKENS, vocab, "abort-while-connecting"),
            MODEL_NAME,
            ABANDONED_MAX_TOKENS,
            0,
            {**REQUEST_FIELDS, "stream": True},
        )
        prefilled = driver.post_json(
            spare.url + "/v1/completions", prefill_body(request), REQUEST_TIMEOUT
        )
        assert spare.metric(KV_USAGE) > idle_usage[spare.name], "the spare holds no blocks"
        os.killpg(spare.launched.pgid, signal.SIGSTOP)
        thawed = False
        try:
            host, port = pair.decode.url.removeprefix("http://").split(":")
            client = http.client.HTTPConnection(host, int(port), timeout=REQUEST_TIMEOUT)
            body = json.dumps(decode_body(request, prefilled))
            client.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            driver.wait_until(
                lambda: pair.decode.metric(WAITING_BY_REASON, 'reason="deferred"') >= 1,
                timeout=METRIC_TIMEOUT,
                what="the decode engine holds the request for its KV transfer",
            )
            client.close()  # the client walks away: vLLM aborts the request
            driver.wait_until(
                functools.partial(idle, pair.decode, idle_usage[pair.decode.name]),
                timeout=METRIC_TIMEOUT,
                what="the decode engine dropped the aborted request and freed its blocks",
            )
            os.killpg(spare.launched.pgid, signal.SIGCONT)
            thawed = True
            began = time.monotonic()
            driver.wait_until(
                lambda: spare.metric(KV_USAGE) <= idle_usage[spare.name],
                timeout=60.0,
                what="the spare prefill engine freed the aborted request's blocks",
            )
        finally:
            if not thawed:
                os.killpg(spare.launched.pgid, signal.SIGCONT)
        observe(
            pair=pair.label,
            case="abort-during-first-connect",
            seconds_until_prefill_freed=round(time.monotonic() - began, 1),
        )

    def test_a_killed_prefill_engine_is_recomputed_by_decode(
        self,
        pair: Pair,
        processes: Processes,
        baseline_outputs: dict[str, Any],
        case_prompts: list[list[int]],
    ) -> None:
        """A prefill engine of its own (the class's spare: TP 1, blocks of 64) is killed
        (SIGKILL to its process group) while the decode engine's load of its KV is under way:
        the decode engine (`kv_load_failure_policy` "recompute") finds its prefill rank dead,
        counts a failed load, computes the prompt itself and answers the baseline's tokens.

        On one CPU host the copy itself takes milliseconds, so a kill timed to land inside it
        would be a race. The transfer is held open instead: the decode engine connects to the
        spare first (one request through it), then the spare prefills the case and is frozen
        (SIGSTOP); the decode engine's load starts (its fetch sent, nothing answered: vLLM
        holds the request as deferred for its KV transfer), and only then the kill lands.
        """
        assert pair.spare is not None
        doomed = pair.spare
        processes.wait_ready([doomed])

        def through_doomed(index: int) -> tuple[dict[str, Any], dict[str, Any]]:
            request = driver.completion_request(
                case_prompts[index], MODEL_NAME, MAX_TOKENS, 0, REQUEST_FIELDS
            )
            prefilled = driver.post_json(
                doomed.url + "/v1/completions", prefill_body(request), REQUEST_TIMEOUT
            )
            assert prefilled.get("kv_transfer_params"), prefilled
            return request, prefilled

        def decode(request: dict[str, Any], prefilled: dict[str, Any]) -> dict[str, Any]:
            body = decode_body(request, prefilled)
            return driver.post_json(pair.decode.url + "/v1/completions", body, REQUEST_TIMEOUT)

        decode(*through_doomed(0))  # the decode engine is now connected to the spare
        index = next(i for i, c in enumerate(CASES) if c.length == 209)
        request, prefilled = through_doomed(index)
        os.killpg(doomed.launched.pgid, signal.SIGSTOP)
        counters = Counters(pair.decode)
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answered = pool.submit(decode, request, prefilled)
            driver.wait_until(
                lambda: pair.decode.metric(WAITING_BY_REASON, 'reason="deferred"') >= 1,
                timeout=METRIC_TIMEOUT,
                what="the decode engine holds the request for its KV transfer",
            )
            doomed.launched.kill()
            answer = answered.result(timeout=REQUEST_TIMEOUT)
        seconds = time.monotonic() - started
        result = {
            **one_prompt(baseline_outputs, index),
            "outputs": [driver.parse_completion(answer, pair.decode.url)],
        }
        comparison = driver.compare(
            one_prompt(baseline_outputs, index), result, require_transfer=False
        )
        failed = driver.wait_until(
            lambda: counters.failed_since() or None,
            timeout=METRIC_TIMEOUT,
            what="kvxfer's failed-load counter",
        )
        observe(
            pair=pair.label,
            case="prefill-killed",
            same_tokens=comparison.ok,
            kvxfer_failed=failed,
            seconds=round(seconds, 1),
        )
        assert failed >= 1
        assert comparison.ok, "\n".join(comparison.problems)
