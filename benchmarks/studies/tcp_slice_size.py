"""Mooncake's TCP slice size (`MC_TCP_SLICE_SIZE`) against throughput, over loopback: what
kvxfer's default for it rests on (`kvxfer.transport.mooncake.TCP_SLICE_SIZE`).

    MC_LOG_LEVEL=ERROR .venv/bin/python benchmarks/studies/tcp_slice_size.py            # a table
    MC_LOG_LEVEL=ERROR .venv/bin/python benchmarks/studies/tcp_slice_size.py --json     # JSON

Mooncake reads the variable once per process, so every value runs in its own process; values
alternate in a new random order each round (a noisy neighbour hits all alike), and the table
gives the median over `--rounds`. Each process measures, through kvxfer's own transport:

- `read_gbps`: one engine reading 16 MiB from another, one read at a time (one TCP stream);
- `reads_gbps`: four readers reading 16 MiB each from one engine at once;
- `kvxfer_gbps` and `ratio`: one `kvxfer bench` row (`--pair`, 2->4 by default, the cost
  model's strategy and chunks) and its ratio to the contiguous baseline of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from concurrent.futures import Future
from typing import Any

VALUES = (64 << 10, 256 << 10, 1 << 20, 4 << 20)  # Mooncake's default is 64 KiB


def child(pair: str, repeat: int) -> dict[str, Any]:
    """One process's measurements, at the slice size in its environment."""
    import numpy as np
    import torch

    from kvxfer.cli.bench import BenchConfig, bench_row
    from kvxfer.plan import Segments
    from kvxfer.testing.timing import median_seconds
    from kvxfer.transport import Peer
    from kvxfer.transport.mooncake import MooncakeTransport

    torch.set_num_threads(1)
    size, readers = 16 << 20, 4
    server = MooncakeTransport()
    clients = [MooncakeTransport() for _ in range(readers)]
    src = torch.ones(size, dtype=torch.uint8)
    dst = [torch.empty(size, dtype=torch.uint8) for _ in clients]
    region = server.register(src)
    local = [c.register(t) for c, t in zip(clients, dst, strict=True)]
    peer = Peer(server.endpoint, {region.region_id: region})

    def read(i: int) -> Future[None]:
        one = np.ones(1, dtype=np.int64)
        segments = Segments(
            one * region.region_id, one * 0, one * local[i].region_id, one * 0, one * size
        )
        return clients[i].read(segments, peer)

    one = median_seconds(lambda: read(0).result(), 8)
    many = median_seconds(lambda: [f.result() for f in [read(i) for i in range(readers)]], 5)
    for c in clients:
        c.close()
    server.close()
    src_tp, dst_tp = (int(x) for x in pair.split(":"))
    row = bench_row(BenchConfig(src_tp, dst_tp, kv_heads=12, repeat=repeat))
    return {
        "read_gbps": size / one / 1e9,
        "reads_gbps": readers * size / many / 1e9,
        "kvxfer_gbps": row["kvxfer_gbps"],
        "contiguous_gbps": row["contiguous_gbps"],
        "ratio": row["ratio_to_contiguous"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pair", default="2:4", help="the kvxfer bench row, as prefill:decode")
    parser.add_argument("--repeat", type=int, default=3, help="runs per kvxfer bench row")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        from kvxfer.cli.native_logs import filtered_stderr, set_mooncake_log_level

        set_mooncake_log_level(False)
        with filtered_stderr():
            result = child(args.pair, args.repeat)
        print(json.dumps(result))
        return 0
    runs: dict[int, list[dict[str, Any]]] = {v: [] for v in VALUES}
    rng = random.Random(0)
    for _ in range(args.rounds):
        order = list(VALUES)
        rng.shuffle(order)
        for value in order:
            env = {**os.environ, "MC_TCP_SLICE_SIZE": str(value), "MC_LOG_LEVEL": "ERROR"}
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    "--pair",
                    args.pair,
                    "--repeat",
                    str(args.repeat),
                ],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            runs[value].append(json.loads(out.strip().splitlines()[-1]))
    keys = ("read_gbps", "reads_gbps", "kvxfer_gbps", "contiguous_gbps", "ratio")
    table = [
        {
            "slice_bytes": value,
            **{k: statistics.median(r[k] for r in runs[value]) for k in keys},
            **{f"{k}_all": [r[k] for r in runs[value]] for k in keys},
        }
        for value in VALUES
    ]
    if args.json:
        print(json.dumps({"pair": args.pair, "rounds": args.rounds, "rows": table}, indent=2))
        return 0
    print(f"median of {args.rounds} rounds; kvxfer row {args.pair.replace(':', '->')}")
    print(f"{'slice':>8} {'1 read':>8} {'4 reads':>8} {'kvxfer':>8} {'contig':>8} {'ratio':>6}")
    for row in table:
        print(
            f"{row['slice_bytes'] >> 10:>5} KiB {row['read_gbps']:8.2f} {row['reads_gbps']:8.2f} "
            f"{row['kvxfer_gbps']:8.3f} {row['contiguous_gbps']:8.3f} {row['ratio']:6.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
