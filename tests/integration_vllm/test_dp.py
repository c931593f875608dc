"""Data parallelism under vLLM's Scheduler: a prefill engine with DP 2 (TP 2, blocks of 16,
LBNHC) and a decode engine with DP 2 (TP 1, blocks of 32, LBHNC), every DP rank on one node
(127.0.0.1). As vLLM runs them, each DP rank is an engine of its own (its own Scheduler and
workers, engine id `<name>_dp<rank>`, `data_parallel_index` set). Prefill workers bind free
ports and register with the bootstrap service that the scheduler of prefill DP rank 0 runs;
decode workers find the DP rank a request's parameters name through it. KV is checked bit for
bit on every decode rank. Runs in the separate vLLM environment (`make test-vllm`)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import pytest
from pd_engines import (
    Engine,
    EngineSpec,
    failed_load,
    load_and_check,
    prefill_remote,
    random_prompt,
    run_until,
    write_model,
)

from kvxfer.addresses import free_port_run
from kvxfer.integrations.bootstrap import BootstrapClient, BootstrapError

# The longest wait for the engines in this module.
_run_until = functools.partial(run_until, timeout=60.0)

DP, PREFILL_TP, DECODE_TP = 2, 2, 1
COMMON = {"cost_model": "tcp_loopback", "secret": "s3cret"}


def _prefill_spec(dp_rank: int, bootstrap_port: int) -> EngineSpec:
    extra = {**COMMON, "bootstrap_port": bootstrap_port}  # side_channel_port: 0, free ports
    return EngineSpec(
        "prefill", PREFILL_TP, 16, "kv_producer", 64, "LBNHC", extra, dp_rank=dp_rank, dp_size=DP
    )


def _decode_spec(dp_rank: int) -> EngineSpec:
    extra = {**COMMON, "fetch_timeout_s": 15, "handshake_timeout_s": 3}
    return EngineSpec(
        "decode", DECODE_TP, 32, "kv_consumer", 48, "LBHNC", extra, dp_rank=dp_rank, dp_size=DP
    )


@dataclass
class Cluster:
    model: str
    bootstrap: str  # the service's URL
    prefill: list[Engine]  # by DP rank
    decode: list[Engine]
    standby: list[Engine] = field(default_factory=list)  # closed at the end if never started


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = write_model(tmp_path_factory.mktemp("model"))
    port = free_port_run(1)
    prefill = [Engine(model, _prefill_spec(dp, port)) for dp in range(DP)]
    decode = [Engine(model, _decode_spec(dp)) for dp in range(DP)]
    # Prefill DP rank 1 again, for the restart test: its processes import vLLM now.
    standby = Engine(model, _prefill_spec(1, port), hold=True)
    engines = Cluster(model, f"http://127.0.0.1:{port}", prefill, decode, [standby])
    try:
        for engine in [*prefill, *decode]:
            engine.wait_ready()
        yield engines
    finally:
        for engine in [*engines.decode, *engines.prefill[::-1], *engines.standby]:
            engine.close()


def _prefilled(prefill: Engine, request_id: str, prompt: list[int]) -> dict:
    """Prefill a prompt for remote decode; its kv_transfer_params once every prefill rank of
    that DP rank has published it."""
    params = prefill_remote(prefill, {request_id: prompt}, timeout=60.0)
    prefill.step()  # the step whose metadata publishes it
    return params[request_id]


def _decode(decode: Engine, prefills: list[Engine], loads: dict[str, tuple[list, dict]]) -> None:
    """Load requests on one decode DP rank: KV bit-exact on every decode rank as soon as vLLM
    learns a load finished, no load error; then finish them, and their prefill engines report
    them finished sending (`_all_blocks_free` checks that the blocks came back)."""
    errors = len(decode.invalid_block_ids)
    what = f"(loads {sorted(loads)} on {decode.spec.engine_id})"
    seen = load_and_check(decode, prefills, loads, 60.0, what=what)
    assert seen.checked == {r: [[]] * DECODE_TP for r in loads}, "KV differs on a decode rank"
    assert decode.invalid_block_ids[errors:] == [], "a load failed"
    assert decode.free_blocks() == decode.free_blocks_at_start


def _all_blocks_free(cluster: Cluster) -> None:
    for engine in [*cluster.prefill, *cluster.decode]:
        assert engine.free_blocks() == engine.free_blocks_at_start, engine.spec.engine_id


def _registered(client: BootstrapClient, dp_rank: int, timeout: float = 30.0) -> list:
    return client.lookup(f"prefill_dp{dp_rank}", dp_rank, timeout_s=timeout)


def test_each_dp_rank_registers_and_decode_ranks_load_from_the_one_named(cluster):
    client = BootstrapClient(cluster.bootstrap)
    workers = {dp: _registered(client, dp) for dp in range(DP)}
    assert client.engines() == {"prefill_dp0": [0], "prefill_dp1": [1]}
    addresses = [w.address for dp in range(DP) for w in workers[dp]]
    # Two DP ranks on one node: four workers, four ports, no collision.
    assert len(set(addresses)) == DP * PREFILL_TP
    assert all(a.startswith("tcp://127.0.0.1:") for a in addresses)
    assert all(w.tp_size == PREFILL_TP and w.geometry["block_size"] == 16 for w in workers[0])

    # Every (prefill DP rank, decode DP rank) pair.
    routes = {f"req-p{p}-d{d}": (p, d) for p in range(DP) for d in range(DP)}
    prompts = {r: random_prompt(i, 30 + 23 * i) for i, r in enumerate(routes)}
    params = {r: _prefilled(cluster.prefill[p], r, prompts[r]) for r, (p, _) in routes.items()}
    for request_id, (p, _) in routes.items():
        handed = params[request_id]
        assert handed["remote_engine_id"] == f"prefill_dp{p}"
        assert handed["remote_dp_rank"] == p
        assert handed["remote_bootstrap_addr"] == cluster.bootstrap
        assert handed["tp_size"] == PREFILL_TP
        assert "remote_port" not in handed  # free ports: only the service knows them
    for d in range(DP):
        loads = {r: (prompts[r], params[r]) for r, (_, dd) in routes.items() if dd == d}
        _decode(cluster.decode[d], cluster.prefill, loads)
    _all_blocks_free(cluster)


def test_restarted_prefill_dp_rank_registers_again_and_is_found(cluster):
    client = BootstrapClient(cluster.bootstrap)
    before = _registered(client, 1)
    prompt = random_prompt(50, 61)
    _decode(
        cluster.decode[0],
        cluster.prefill,
        {"req-before": (prompt, _prefilled(cluster.prefill[1], "req-before", prompt))},
    )

    # DP rank 1 crashes (no unregister) and comes back: new processes, new free ports. Its
    # workers register again and replace the entries; DP rank 0 and its service stay up.
    crashed = time.monotonic()
    cluster.prefill[1].kill()
    restarted = cluster.standby.pop()
    restarted.start()
    restarted.wait_ready()
    cluster.prefill[1] = restarted
    deadline = time.monotonic() + 30
    while {w.generation for w in _registered(client, 1)} & {w.generation for w in before}:
        assert time.monotonic() < deadline, "the restarted workers did not register again"
        time.sleep(0.1)
    after = _registered(client, 1)
    assert [w.address for w in after] != [w.address for w in before]
    assert all(a.started_at >= b.started_at for a, b in zip(after, before, strict=True))
    # A real engine takes far longer to start than the 2 s in which a decode rank finds a
    # silent prefill rank dead, which makes it look the engine up again.
    time.sleep(max(0.0, crashed + 3.0 - time.monotonic()))

    # Both decode DP ranks loaded from the old DP rank 1; both find the new one.
    prompts = {f"req-after-d{d}": random_prompt(60 + d, 45 + 10 * d) for d in range(DP)}
    for d in range(DP):
        request_id = f"req-after-d{d}"
        handed = _prefilled(restarted, request_id, prompts[request_id])
        _decode(cluster.decode[d], cluster.prefill, {request_id: (prompts[request_id], handed)})
    # DP rank 0 was never disturbed.
    prompt = random_prompt(70, 33)
    handed = _prefilled(cluster.prefill[0], "req-dp0-after", prompt)
    _decode(cluster.decode[1], cluster.prefill, {"req-dp0-after": (prompt, handed)})
    _all_blocks_free(cluster)


def test_a_dp_rank_the_service_does_not_know_fails_the_load_and_vllm_recomputes(cluster):
    decode = cluster.decode[0]
    prompt = random_prompt(80, 40)
    nowhere = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill_dp7",
        "remote_request_id": "req-x",
        "remote_bootstrap_addr": cluster.bootstrap,
        "remote_dp_rank": 7,
        "remote_num_tokens": len(prompt),
        "tp_size": PREFILL_TP,
    }
    # The look-up waits handshake_timeout_s (3 s) for ranks that may still register.
    reported, blocks = failed_load(decode, "req-unknown-dp", prompt, nowhere)
    assert reported and set().union(*reported) == set(blocks[:2])  # 40 tokens, blocks of 32
    assert decode.free_blocks() == decode.free_blocks_at_start


def test_a_prefill_dp_rank_that_shuts_down_unregisters(cluster):
    client = BootstrapClient(cluster.bootstrap)
    assert len(_registered(client, 1)) == PREFILL_TP
    cluster.prefill.pop(1).close()
    with pytest.raises(BootstrapError, match=r"'prefill_dp1' DP rank 1 has no registered worker"):
        client.workers("prefill_dp1", 1)
    assert client.engines() == {"prefill_dp0": [0]}
