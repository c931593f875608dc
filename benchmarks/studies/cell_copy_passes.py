"""One pass or two: gathering rows into a dense staging buffer on the CPU.

`kernels/copy_cells_torch.py` gathers straight into a dense destination (the wire layout of
pack+unpack) with `index_select(..., out=...)`, and scatters straight from a dense source,
instead of `index_select` into a temporary and `index_copy_` out of it. This measures the two on
the same rows, one torch thread, and checks they agree bit for bit.

    .venv/bin/python benchmarks/studies/cell_copy_passes.py [--rows 65536] [--row-bytes 768]
"""

from __future__ import annotations

import argparse

import torch

from kvxfer.testing.timing import median_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--row-bytes", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    torch.set_num_threads(1)
    words = args.row_bytes // 8
    src = torch.randint(0, 1 << 62, (2 * args.rows, words), dtype=torch.int64)
    rows = torch.randperm(2 * args.rows)[: args.rows]
    dense = torch.arange(args.rows)
    two_out = torch.zeros(args.rows, words, dtype=torch.int64)
    one_out = torch.zeros(args.rows, words, dtype=torch.int64)

    def two_passes() -> None:
        two_out.index_copy_(0, dense, src.index_select(0, rows))

    def one_pass() -> None:
        torch.index_select(src, 0, rows, out=one_out[: args.rows])

    nbytes = args.rows * args.row_bytes
    for name, fn in (("two passes", two_passes), ("one pass", one_pass)):
        seconds = median_seconds(fn, args.repeats)
        print(f"{name:10}  {seconds * 1e3:7.2f} ms  {nbytes / seconds / 1e9:5.2f} GB/s")
    print("bit-exact:", torch.equal(one_out, two_out))


if __name__ == "__main__":
    main()
