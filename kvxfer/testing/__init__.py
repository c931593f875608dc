"""One test harness for kvxfer: geometries, poisoned memory, and ranks in real processes.

Used by the test suite, the fault suite (tests/faults) and the soak run (benchmarks/soak.py);
it imports neither pytest nor Hypothesis (the Hypothesis strategies are in
`kvxfer.testing.strategies`).

- `kvxfer.testing.geometry`: `Geometry` (one engine's cache shape and sharding: every rank's
  `KVCacheSpec`), `Request`, `side_specs`, block tables.
- `kvxfer.testing.memory`: the poison bytes (`POISON`, `REPOISON`, `SOURCE_FILL`), raw-byte
  views by block, `CacheModel` (what a destination cache must hold, byte for byte, from
  `kvxfer.reference`), `BlockPool`.
- `kvxfer.testing.scenario`: in-process sources and poisoned destinations of one request.
- `kvxfer.testing.cluster`: `run_cluster`, a whole transfer between prefill and decode ranks
  in separate processes, every byte checked.
- `kvxfer.testing.rig`: `Rig`, rank processes driven command by command, to be SIGSTOPped,
  SIGCONTed or SIGKILLed at a chosen point; `kvxfer.testing.checks`: what the fault suite
  checks with them (progress, leaks, late bytes, hostile frames); `kvxfer.testing.links`:
  `StallingLink`, a relay whose connections stop carrying bytes (a process run in bursts).
- Real engines (`make test-e2e`, `benchmarks/pd_serve.py`, `benchmarks/pd_soak.py`, the GPU
  scripts): `kvxfer.testing.tiny_model` (a tiny model made on the spot),
  `kvxfer.testing.vllm_driver` (prompts, HTTP calls, comparison, process groups; standard
  library only) and `kvxfer.testing.vllm_cpu_engines` (vLLM CPU engines and the P/D proxy as
  processes). None is imported here: they are modules of their own for the scripts that run
  in an engine's environment.
- Benchmarks: `kvxfer.testing.results`, the one result schema and `--record` flag every
  benchmark shares (`benchmarks/RESULTS.md` is made from its files).
"""

from kvxfer.testing.checks import (
    describe,
    garbage_frames,
    leaks,
    poll,
    pools_whole,
    send_raw,
    wait_for_progress,
    wait_until,
    watch_for_late_bytes,
)
from kvxfer.testing.cluster import ClusterRun, run_cluster
from kvxfer.testing.geometry import (
    Geometry,
    Request,
    random_block_table,
    request_blocks,
    side_specs,
)
from kvxfer.testing.links import StallingLink
from kvxfer.testing.memory import (
    POISON,
    REPOISON,
    SOURCE_FILL,
    BlockPool,
    CacheModel,
    bits,
    block_diff,
    by_block,
    fill_blocks,
    global_kv,
    poison,
)
from kvxfer.testing.rig import (
    DECODE,
    PREFILL,
    ROOMY_STAGING,
    SLOW_STAGING,
    ChildError,
    Consumer,
    Proc,
    Producer,
    Rig,
)
from kvxfer.testing.scenario import Scenario, make_scenario

__all__ = [
    "DECODE",
    "POISON",
    "PREFILL",
    "REPOISON",
    "ROOMY_STAGING",
    "SLOW_STAGING",
    "SOURCE_FILL",
    "BlockPool",
    "CacheModel",
    "ChildError",
    "ClusterRun",
    "Consumer",
    "Geometry",
    "Proc",
    "Producer",
    "Request",
    "Rig",
    "Scenario",
    "StallingLink",
    "bits",
    "block_diff",
    "by_block",
    "describe",
    "fill_blocks",
    "garbage_frames",
    "global_kv",
    "leaks",
    "make_scenario",
    "poison",
    "poll",
    "pools_whole",
    "random_block_table",
    "request_blocks",
    "run_cluster",
    "send_raw",
    "side_specs",
    "wait_for_progress",
    "wait_until",
    "watch_for_late_bytes",
]
