"""Hetero-TP transfer throughput through Mooncake (TCP loopback by default).

    .venv/bin/python benchmarks/transfer.py                 # table
    .venv/bin/python benchmarks/transfer.py --json          # {"rows": [...]}

The same as `kvxfer bench` (see kvxfer/cli/bench.py): per row, kvxfer's throughput, one contiguous
write of the same bytes and a naive write with one descriptor per (token, layer, K/V), all
measured in this run through the same engines. Targets: at least 0.8 of contiguous, at least
10x naive.
"""

import sys

from kvxfer.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
