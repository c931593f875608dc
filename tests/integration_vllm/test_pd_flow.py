"""vLLM's Scheduler drives a prefill engine (TP 2, blocks of 16, KV cache layout LBNHC) and a decode
engine (TP 3, blocks of 32, layout LBHNC) through the P/D flow with kvxfer's connector on both
sides: TP sizes that do not divide each other, different block sizes and layouts, KV tensors
allocated by vLLM's own allocator. Runs in the separate vLLM environment (`make test-vllm`)."""

from __future__ import annotations

import functools
import json
import time
import urllib.request
from dataclasses import dataclass, field

import pytest
from pd_engines import (
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    Engine,
    EngineSpec,
    failed_load,
    load_and_check,
    random_prompt,
    run_until,
    write_model,
)

from kvxfer.addresses import free_port_run

# The longest wait for the engines in this module.
_run_until = functools.partial(run_until, timeout=90.0)

PREFILL_TP, DECODE_TP = 2, 3
DECODE_BLOCK = 32
COMMON = {"cost_model": "tcp_loopback", "secret": "s3cret"}
REQUEST_TIMEOUT_S = 120  # how long a prefill engine holds blocks no decode engine released
# A decode load's limit: loads of requests never published fail then. Long enough that a load
# beside them finishes first however slowly a loaded machine runs it.
FETCH_TIMEOUT_S = 20


def _prefill_spec(port: int) -> EngineSpec:
    extra = {**COMMON, "side_channel_port": port, "request_timeout_s": REQUEST_TIMEOUT_S}
    return EngineSpec("prefill-engine", PREFILL_TP, 16, "kv_producer", 64, "LBNHC", extra)


@dataclass
class Cluster:
    """The module's engines; a test that restarts the prefill engine replaces it here."""

    model: str
    prefill: Engine
    decode: Engine
    port: int
    standby: list[Engine] = field(default_factory=list)  # closed at the end if never started

    def __iter__(self):
        return iter((self.prefill, self.decode, self.port))


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    model = write_model(tmp_path_factory.mktemp("model"))
    port = free_port_run(PREFILL_TP)
    common = COMMON
    prefill = Engine(model, _prefill_spec(port))
    decode = Engine(
        model,
        EngineSpec(
            "decode-engine",
            DECODE_TP,
            DECODE_BLOCK,
            "kv_consumer",
            48,
            "LBHNC",
            {
                **common,
                "fetch_timeout_s": FETCH_TIMEOUT_S,
                "handshake_timeout_s": 2,
            },
        ),
    )
    cluster = Cluster(model, prefill, decode, port)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield cluster
    finally:
        cluster.decode.close()
        for engine in [cluster.prefill, *cluster.standby]:
            engine.close()


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


def test_pd_flow_moves_kv_bit_exact_and_frees_blocks(engines):
    prefill, decode, port = engines
    prompts = {
        "req-a": random_prompt(1, 45),
        "req-b": random_prompt(2, 100),
        "req-c": random_prompt(3, 17),
    }
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
        bootstrap = prefill.spec.extra["bootstrap_port"]
        assert p["remote_bootstrap_addr"] == f"http://127.0.0.1:{bootstrap}"
        assert p["remote_dp_rank"] == 0
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


def test_concurrent_flow_as_vllm_router_sends_it_in_mooncake_mode(engines):
    """`vllm-router --kv-connector mooncake`: it reads the prefill engine's id per DP rank from
    the bootstrap service's `/query`, mints a `transfer_id`, and sends the request to both
    engines at once: the decode engine allocates its blocks and asks for the KV (streamed)
    before the prefill engine has computed it. The prefill engine offers a one-token request
    under the transfer id in the very step that schedules its prompt, and each attention layer
    is marked ready as the forward pass saves it (`save_kv_layer`); a request that goes on
    decoding there (`max_tokens` 2, which a later step could preempt) is offered only when it
    finishes. Bit-exact on every decode rank, and both engines' blocks come back."""
    prefill, decode, _ = engines
    bootstrap = f"http://127.0.0.1:{prefill.spec.extra['bootstrap_port']}"
    with urllib.request.urlopen(f"{bootstrap}/query", timeout=10) as answer:
        query = json.loads(answer.read())
    assert set(query) == {"0"}
    engine_id = query["0"]["engine_id"]
    assert engine_id == "prefill-engine"
    assert sorted(query["0"]["worker_addr"]) == [str(t) for t in range(PREFILL_TP)]
    prompts = {"req-x": random_prompt(11, 70), "req-y": random_prompt(12, 20)}
    max_tokens = {"req-x": 1, "req-y": 2}
    loads = {}
    first_step = len(prefill.metadata)
    for request_id, prompt in prompts.items():
        transfer_id = f"xfer-{request_id}"  # what the router mints
        prefill.add(
            request_id,
            prompt,
            max_tokens=max_tokens[request_id],
            params={
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "transfer_id": transfer_id,
            },
        )
        decode_params = {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "transfer_id": transfer_id,
            "remote_bootstrap_addr": bootstrap,
            "remote_engine_id": engine_id,
        }
        loads[request_id] = (prompt, decode_params)
    # The decode engine steps first: its loads start before the prefill computes anything.
    seen = load_and_check(decode, [prefill], loads, timeout=90.0, what="(concurrent flow)")
    assert seen.checked == {r: [[]] * DECODE_TP for r in prompts}, "KV differs on a decode rank"
    assert seen.first_compute == {r: 1 for r in prompts}  # only the last prompt token
    sends = [
        (step, send) for step, m in enumerate(prefill.metadata[first_step:]) for send in m.sends
    ]
    offered = {send.request_id: (step, send) for step, send in sends}
    assert len(sends) == len(offered) == 2  # one offer each
    streamed_step, streamed = offered["req-x"]
    assert streamed_step == 0 and streamed.ready_tokens == 0  # as its prompt is scheduled
    assert streamed.offered_as == "xfer-req-x" and streamed.num_tokens == 70
    late_step, late = offered["req-y"]
    assert late_step > 0 and late.ready_tokens is None  # once it finished
    decode_loads = [load for m in decode.metadata for load in m.loads if load.request_id in loads]
    assert {load.request_id: load.streamed for load in decode_loads} == {
        "req-x": True,
        "req-y": True,
    }
    assert prefill.free_blocks() == prefill.free_blocks_at_start
    assert decode.free_blocks() == decode.free_blocks_at_start


def test_a_transfer_id_used_twice_frees_the_second_request_and_keeps_the_engine(engines):
    """A router that reuses a `transfer_id` (a retry, a bug): the second prefill request cannot
    be offered under it. The prefill engine keeps running and frees that request's blocks at
    once; the first request stays offered until its decode engine is done with it."""
    prefill, decode, _ = engines
    bootstrap = f"http://127.0.0.1:{prefill.spec.extra['bootstrap_port']}"
    params = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "xfer-dup"}
    prompt = random_prompt(21, 40)
    finished: set[str] = set()

    def collect(_, outputs):
        finished.update(o.request_id for o in outputs if o.finish_reason is not None)

    prefill.add("req-first", prompt, max_tokens=1, params=dict(params))
    _run_until(lambda: "req-first" in finished, [prefill], on_step=collect)
    prefill.add("req-again", random_prompt(22, 50), max_tokens=1, params=dict(params))
    _run_until(lambda: "req-again" in prefill.finished_sending, [prefill])
    assert "req-first" not in prefill.finished_sending  # still offered, for its decode
    decode_params = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "transfer_id": "xfer-dup",
        "remote_bootstrap_addr": bootstrap,
        "remote_engine_id": "prefill-engine",
    }
    seen = load_and_check(decode, [prefill], {"req-first": (prompt, decode_params)}, 90.0)
    assert seen.checked == {"req-first": [[]] * DECODE_TP}
    assert prefill.free_blocks() == prefill.free_blocks_at_start


def test_failed_load_reports_exactly_its_blocks_and_vllm_recomputes(engines):
    _, decode, port = engines
    finished: set[str] = set()
    first_compute: dict[str, int] = {}

    def follow(engine, outputs):
        for request_id, count in engine.last_scheduled.items():
            first_compute.setdefault(request_id, count)
        finished.update(o.request_id for o in outputs if o.finish_reason is not None)

    # A request computed on the decode engine itself leaves two full blocks in its prefix cache.
    shared = random_prompt(5, 2 * DECODE_BLOCK)
    decode.add("req-local", [*shared, *random_prompt(6, 10)], max_tokens=1, params=None)
    _run_until(lambda: "req-local" in finished, [decode], on_step=follow)

    # A remote prefill of a prompt that starts with those blocks, whose KV never arrives.
    prompt = [*shared, *random_prompt(7, 6)]
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
    prompt = random_prompt(8, 40)
    # Nothing listens where this engine is said to be.
    nowhere = _remote_params("gone-engine", "req-x", free_port_run(PREFILL_TP), len(prompt))
    reported, load_blocks = failed_load(decode, "req-nowhere", prompt, nowhere)
    assert reported and set().union(*reported) == set(load_blocks[:2])  # 40 tokens, blocks of 32
    assert decode.free_blocks() == decode.free_blocks_at_start


# ---- faults: stalled neighbours, decode-side aborts, restarted prefill engines ----------------


def _finished(outputs) -> set[str]:
    return {o.request_id for o in outputs if o.finish_reason is not None}


def _prefilled(prefill: Engine, request_id: str, prompt: list[int]) -> dict:
    """Prefill a prompt for remote decode; its kv_transfer_params once every prefill rank has
    published it."""
    params: dict[str, dict] = {}

    def collect(_, outputs):
        params.update({o.request_id: o.kv_transfer_params for o in outputs if o.finish_reason})

    prefill.add(request_id, prompt, max_tokens=1, params={"do_remote_decode": True})
    _run_until(lambda: request_id in params, [prefill], on_step=collect)
    prefill.step()  # the step whose metadata publishes it
    return params[request_id]


def _loaded_kv_mismatches(decode: Engine, request_id: str, prompt: list[int]) -> list[list[int]]:
    block_ids = decode.scheduler.kv_cache_manager.get_block_ids(request_id)[0]
    return decode.check(prompt, list(block_ids), len(prompt))


def _round_trip(prefill: Engine, decode: Engine, request_id: str, prompt: list[int]) -> None:
    """Prefill a prompt, load it on the decode engine (KV bit-exact on every decode rank, no
    load error), finish it there; the prefill engine frees its blocks."""
    params = _prefilled(prefill, request_id, prompt)
    decode.add(request_id, prompt, max_tokens=2, params=params)
    decode.step()
    blocks = set(decode.scheduler.kv_cache_manager.get_block_ids(request_id)[0])
    errors = len(decode.invalid_block_ids)
    _run_until(
        lambda: request_id in decode.finished_recving,
        [decode, prefill],
        timeout=30,
        what=f"({request_id}: the decode engine's load did not finish)",
    )
    assert _loaded_kv_mismatches(decode, request_id, prompt) == [[]] * DECODE_TP
    assert not blocks & set().union(*decode.invalid_block_ids[errors:]), "its load failed"
    finished: set[str] = set()
    _run_until(
        lambda: request_id in finished and request_id in prefill.finished_sending,
        [decode, prefill],
        timeout=30,
        what=f"({request_id}: the prefill engine did not free its blocks)",
        on_step=lambda engine, outs: finished.update(_finished(outs) if engine is decode else ()),
    )
    assert prefill.free_blocks() == prefill.free_blocks_at_start


def test_loads_of_requests_never_published_do_not_delay_a_ready_load(engines):
    from vllm.v1.request import RequestStatus

    prefill, decode, port = engines
    # Ten loads that wait for requests the prefill engine never publishes (lost, or a proxy bug).
    ghosts = {f"ghost-{i}": random_prompt(100 + i, 40) for i in range(10)}
    for request_id, prompt in ghosts.items():
        params = _remote_params("prefill-engine", f"never-{request_id}", port, len(prompt))
        decode.add(request_id, prompt, max_tokens=1, params=params)
    errors = len(decode.invalid_block_ids)
    ghosts_began = time.monotonic()
    decode.step()  # every decode rank starts the ten loads
    ghost_blocks = {
        b for g in ghosts for b in decode.scheduler.kv_cache_manager.get_block_ids(g)[0]
    }
    waiting = RequestStatus.WAITING_FOR_REMOTE_KVS
    assert all(decode.scheduler.requests[g].status == waiting for g in ghosts)

    # A request the prefill engine did publish loads beside them, at its normal speed.
    ready = random_prompt(120, 100)
    params = _prefilled(prefill, "req-ready", ready)
    decode.add("req-ready", ready, max_tokens=1, params=params)
    _run_until(lambda: "req-ready" in decode.finished_recving, [decode, prefill])
    # Not delayed by them: it finished while every ghost still waited for its timeout.
    assert not decode.finished_recving & set(ghosts), "the ghosts' loads ended too soon"
    assert _loaded_kv_mismatches(decode, "req-ready", ready) == [[]] * DECODE_TP
    assert not decode.invalid_block_ids[errors:], "a load failed"

    # The ghosts fail at their timeout with exactly their blocks; vLLM computes them locally.
    finished: set[str] = set()
    _run_until(
        lambda: finished >= {*ghosts, "req-ready"} and "req-ready" in prefill.finished_sending,
        [decode, prefill],
        timeout=FETCH_TIMEOUT_S * 6,
        on_step=lambda engine, outs: finished.update(_finished(outs) if engine is decode else ()),
    )
    assert time.monotonic() - ghosts_began >= FETCH_TIMEOUT_S
    assert set().union(*decode.invalid_block_ids[errors:]) == ghost_blocks
    # Loads after ten timed-out ones still work.
    _round_trip(prefill, decode, "req-after-ghosts", random_prompt(121, 70))
    assert decode.free_blocks() == decode.free_blocks_at_start


def _until_done(
    engine: Engine, request_id: str, stepping: list[Engine], timeout: float, what: str
) -> None:
    """Step `stepping` until `engine` is done with `request_id` (its load, on a decode engine;
    its sending, on a prefill engine), then check that it holds every block it started with."""
    kind = "recving" if engine.spec.role == "kv_consumer" else "sending"
    done = lambda: request_id in getattr(engine, f"finished_{kind}")  # noqa: E731
    _run_until(done, stepping, timeout=timeout, what=what)
    assert engine.free_blocks() == engine.free_blocks_at_start


def test_decode_abort_before_the_load_frees_the_prefill_blocks_at_once(engines):
    from vllm.v1.request import RequestStatus

    prefill, decode, _ = engines
    prompt = random_prompt(130, 90)
    params = _prefilled(prefill, "req-abort-waiting", prompt)
    assert prefill.free_blocks_at_start - prefill.free_blocks() == -(-len(prompt) // 16)
    decode.add("req-abort-waiting", prompt, max_tokens=1, params=params)
    # The client goes away before the decode engine scheduled it: no block, no load. Freed
    # "at once" is told from freed at the request's timeout (120 s), not by this machine's speed.
    decode.scheduler.finish_requests("req-abort-waiting", RequestStatus.FINISHED_ABORTED)
    _until_done(
        prefill,
        "req-abort-waiting",
        [decode, prefill],
        REQUEST_TIMEOUT_S / 4,
        "(the prefill engine still holds the aborted request's blocks)",
    )
    assert decode.free_blocks() == decode.free_blocks_at_start


def test_decode_abort_during_the_load_frees_both_sides(engines):
    from vllm.v1.request import RequestStatus

    prefill, decode, _ = engines
    prompt = random_prompt(131, 90)
    params = _prefilled(prefill, "req-abort-loading", prompt)
    errors = len(decode.invalid_block_ids)
    decode.add("req-abort-loading", prompt, max_tokens=1, params=params)
    # The load starts and gets no answer; a frozen prefill is not taken for dead (its kernel
    # accepts the decode's connection: docs/connectors.md, "Failures").
    prefill.freeze()
    try:
        decode.step()
        request = decode.scheduler.requests["req-abort-loading"]
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        decode.scheduler.finish_requests("req-abort-loading", RequestStatus.FINISHED_ABORTED)
        # Every decode worker gives the load up at once: vLLM frees the decode blocks while
        # the prefill engine is still frozen, well before the load could end otherwise (at its
        # fetch timeout).
        _until_done(
            decode,
            "req-abort-loading",
            [decode],
            FETCH_TIMEOUT_S / 2,
            "(the aborted load did not end)",
        )
    finally:
        prefill.thaw()
    # Once thawed, the prefill engine hears of the abort and frees the blocks: well within its
    # request timeout, which would free them otherwise.
    _until_done(
        prefill,
        "req-abort-loading",
        [decode, prefill],
        REQUEST_TIMEOUT_S / 4,
        "(the prefill engine still holds the aborted request's blocks)",
    )
    assert decode.invalid_block_ids[errors:] == [], "an aborted load has nothing to recompute"


def test_decode_abort_during_its_first_connect_reaches_the_prefill_without_a_step(engines):
    """A decode engine aborts a request while its worker's first connect to the prefill
    engine (look-up and handshake, off the step) is still under way, then never steps again
    (its only request is gone). The connect's own task delivers the abort the moment it is
    connected: the prefill engine frees the blocks at once, not at its request_timeout_s."""
    from vllm.v1.request import RequestStatus

    prefill = engines.prefill
    fresh = Engine(
        engines.model,
        EngineSpec(
            "decode-first-connect",
            1,
            DECODE_BLOCK,
            "kv_consumer",
            48,
            "LBHNC",
            # Long enough that the handshake outlasts the frozen prefill engine below.
            {**COMMON, "fetch_timeout_s": 60, "handshake_timeout_s": 60},
        ),
    )
    try:
        fresh.wait_ready()
        prompt = random_prompt(132, 70)
        params = _prefilled(prefill, "req-abort-connecting", prompt)
        prefill.freeze()  # its workers answer no handshake: the first connect hangs
        try:
            fresh.add("req-abort-connecting", prompt, max_tokens=1, params=params)
            fresh.step()  # the load starts: a connect in the background
            fresh.scheduler.finish_requests("req-abort-connecting", RequestStatus.FINISHED_ABORTED)
            _until_done(
                fresh, "req-abort-connecting", [fresh], 20, "(the aborted load did not end)"
            )
        finally:
            prefill.thaw()
        # The decode engine has nothing left to step; only the prefill engine runs on.
        _until_done(
            prefill,
            "req-abort-connecting",
            [prefill],
            REQUEST_TIMEOUT_S / 4,
            "(the abort never reached the prefill engine)",
        )
    finally:
        fresh.close()


def test_restarted_prefill_engine_is_found_again(engines):
    cluster = engines
    decode = cluster.decode
    # The same prefill engine (same engine_id) twice more: on other ports, then back on those.
    new_port = free_port_run(PREFILL_TP)
    moved = Engine(cluster.model, _prefill_spec(new_port), hold=True)
    same_ports = Engine(cluster.model, _prefill_spec(new_port), hold=True)
    cluster.standby += [moved, same_ports]
    _round_trip(cluster.prefill, decode, "req-before-restart", random_prompt(140, 50))

    # A crash; the engine comes back on other ports: the decode engine's next load connects
    # to them (the kv_transfer_params name the engine's bootstrap service, which names them).
    cluster.prefill.kill()
    moved.start()
    moved.wait_ready()
    cluster.standby.remove(moved)
    cluster.prefill, cluster.port = moved, new_port
    _round_trip(moved, decode, "req-new-ports", random_prompt(141, 77))

    # Another crash; this time it comes back on the same ports (after the 2 s in which decode
    # ranks find a silent prefill rank dead: a real engine takes far longer to start).
    moved.kill()
    time.sleep(3.0)
    same_ports.start()
    same_ports.wait_ready()
    cluster.standby.remove(same_ports)
    cluster.prefill = same_ports
    _round_trip(same_ports, decode, "req-same-ports", random_prompt(142, 64))
    assert decode.free_blocks() == decode.free_blocks_at_start
