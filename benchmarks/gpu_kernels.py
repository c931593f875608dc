"""GPU benchmark of the Triton cell-copy kernels: correctness first, then bandwidth.

On a CUDA machine:

    python benchmarks/gpu_kernels.py            # full table, about 3 minutes on one H200
    python benchmarks/gpu_kernels.py --json     # the same as one JSON object

Each kernel is first checked bit for bit against its torch implementation (outputs poisoned).
Then, for 1k to 128k tokens, 32 and 64 layers, 8 KV heads, head_dim 128, bf16, with a
scattered block table of 16-token blocks (NHD, kv_first), it reports the median time of
`triton.testing.do_bench`, GB/s (bytes moved, read once and written once), and the ratios to a
torch device-to-device `copy_` of the same bytes and to the torch implementation, all measured
in the same run. The target is at least 85% of copy bandwidth for the wire layout.

`--tiny` runs everything at toy sizes; with TRITON_INTERPRET=1 it runs on CPU tensors, timed
with perf_counter (meaningless numbers). The test suite runs it so that the script cannot rot
unnoticed. `--check-only` stops after the correctness checks.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import torch

from kvxfer.kernels import (
    KVBuffer,
    copy_cells,
    gather_kv,
    gather_kv_torch,
    remap_kv,
    remap_kv_torch,
    scatter_kv,
    scatter_kv_torch,
    wire_kv_buffer,
)

HEADS, HEAD_DIM, BLOCK = 8, 128, 16


def _poison(t: torch.Tensor) -> torch.Tensor:
    t.view(torch.uint8).fill_(0xA5)
    return t


def _fill(t: torch.Tensor, seed: int) -> torch.Tensor:
    # Random bit patterns, generated on the device (randn on 32 GB would dominate the run).
    torch.manual_seed(seed)
    t.view(torch.int16).random_()
    return t


def make_cache(
    layers: int,
    tokens: int,
    device: str,
    layout: str = "NHD",
    mla: bool = False,
    seed: int = 0,
    block: int = BLOCK,
) -> KVBuffer:
    """A paged cache that holds exactly `tokens` tokens in scattered blocks."""
    num_blocks = -(-tokens // block)
    heads = 1 if mla else HEADS
    if mla:
        shape: tuple[int, ...] = (num_blocks, block, HEAD_DIM)
    elif layout == "NHD":
        shape = (2, num_blocks, block, heads, HEAD_DIM)
    else:
        shape = (2, num_blocks, heads, block, HEAD_DIM)
    caches = [
        _fill(torch.empty(shape, dtype=torch.bfloat16, device=device), seed + i)
        for i in range(layers)
    ]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(num_blocks, generator=gen).to(device)
    return KVBuffer(caches, layout, "kv_first", mla, ids, 0, 0)


def make_wire(layers: int, tokens: int, device: str, mla: bool = False) -> torch.Tensor:
    """A poisoned wire buffer `[layers, 2, tokens, heads, head_dim]` (MLA: no plane axis)."""
    shape = (layers, tokens, HEAD_DIM) if mla else (layers, 2, tokens, HEADS, HEAD_DIM)
    return _poison(torch.empty(shape, dtype=torch.bfloat16, device=device))


def _same_bits(a: list[torch.Tensor] | torch.Tensor, b: list[torch.Tensor] | torch.Tensor) -> bool:
    a_list = a if isinstance(a, list) else [a]
    b_list = b if isinstance(b, list) else [b]
    return all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for x, y in zip(a_list, b_list, strict=True)
    )


def check_kernels(device: str, layers: int, tokens: int) -> list[str]:
    """Check every kernel against its torch implementation; return the failures."""
    failures = []
    heads = HEADS
    for mla in (False, True):
        n = 1 if mla else heads
        tag = "MLA " if mla else ""
        cache = make_cache(layers, tokens, device, mla=mla)
        wires = [make_wire(layers, tokens - 3, device, mla) for _ in range(2)]
        gather_kv(cache, wire_kv_buffer(wires[0], 3, mla), 3, tokens, n)
        gather_kv_torch(cache, wire_kv_buffer(wires[1], 3, mla), 3, tokens, n)
        if not _same_bits(wires[0], wires[1]):
            failures.append(f"{tag}gather_kv")
        targets = [make_cache(layers, tokens, device, mla=mla, seed=9) for _ in range(2)]
        for t in targets:
            for layer in t.layers:
                _poison(layer)
        scatter_kv(wire_kv_buffer(wires[0], 3, mla), targets[0], 3, tokens, n)
        scatter_kv_torch(wire_kv_buffer(wires[0], 3, mla), targets[1], 3, tokens, n)
        if not _same_bits(list(targets[0].layers), list(targets[1].layers)):
            failures.append(f"{tag}scatter_kv")
        if not mla:
            outs = []
            for op in (remap_kv, remap_kv_torch):
                dst = make_cache(layers, tokens, device, layout="HND", seed=5, block=48)
                for layer in dst.layers:
                    _poison(layer)
                op(cache, dst, 3, tokens, n)
                outs.append(list(dst.layers))
            if not _same_bits(outs[0], outs[1]):
                failures.append("remap_kv NHD/16 -> HND/48")
    return failures


def _median_ms(fn: Callable[[], object]) -> float:
    if torch.cuda.is_available():
        import triton.testing

        return float(triton.testing.do_bench(fn, return_mode="median"))
    # CPU (the interpreter, --tiny): exercises the script; the times mean nothing.
    samples = []
    for _ in range(3):
        began = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - began) * 1e3)
    return sorted(samples)[1]


def bench_row(layers: int, tokens: int, device: str) -> dict[str, object]:
    """Time gather, scatter, remap, their torch versions, and a plain copy of the same bytes."""
    cache = make_cache(layers, tokens, device)
    wire = make_wire(layers, tokens, device)
    wire_buf = wire_kv_buffer(wire, 0)
    nbytes = wire.numel() * wire.element_size()
    # One buffer of the same bytes serves as the copy's destination and as the remap target
    # (an HND cache of the same blocks): 3x the request's bytes in all, 96 GB at the largest row.
    spare = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    blocks = -(-tokens // BLOCK)
    target = KVBuffer(
        list(spare.view(layers, 2, blocks, HEADS, BLOCK, HEAD_DIM).unbind(0)),
        "HND",
        "kv_first",
        False,
        torch.randperm(blocks, device=device),
    )
    flat_wire = wire.view(-1)
    ops: dict[str, Callable[[], object]] = {
        "copy": lambda: spare.copy_(flat_wire),
        "gather": lambda: gather_kv(cache, wire_buf, 0, tokens, HEADS),
        "gather_torch": lambda: gather_kv_torch(cache, wire_buf, 0, tokens, HEADS),
        "scatter": lambda: scatter_kv(wire_buf, cache, 0, tokens, HEADS),
        "scatter_torch": lambda: scatter_kv_torch(wire_buf, cache, 0, tokens, HEADS),
        "remap": lambda: remap_kv(cache, target, 0, tokens, HEADS),
    }
    row: dict[str, object] = {"layers": layers, "tokens": tokens, "bytes": nbytes}
    times = {name: _median_ms_or_none(fn) for name, fn in ops.items()}
    for name, ms in times.items():
        row[f"{name}_ms"] = ms
        row[f"{name}_gbps"] = _ratio(2 * nbytes / 1e6, ms)  # read + write
    for op in ("gather", "scatter", "remap"):
        row[f"{op}_vs_copy"] = _ratio(times["copy"], times[op])
    for op in ("gather", "scatter"):
        row[f"{op}_vs_torch"] = _ratio(times[f"{op}_torch"], times[op])
    return row


def _median_ms_or_none(fn: Callable[[], object]) -> float | None:
    # The largest rows hold 3x a 34 GB request; a torch implementation's temporaries may not
    # fit beside them. Such a cell is reported as missing instead of losing the whole run.
    try:
        return _median_ms(fn)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None else num / den


def _fmt(value: object, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def sweep_block_t(layers: int, tokens: int, device: str) -> dict[int, float]:
    """Gather bandwidth (GB/s) for each tile height, to check the tile heuristic."""
    cache = make_cache(layers, tokens, device)
    wire = make_wire(layers, tokens, device)
    nbytes = wire.numel() * wire.element_size()
    out = {}
    for block_t in (8, 16, 32, 64, 128):
        ms = _median_ms(
            lambda b=block_t: copy_cells(
                cache, wire_kv_buffer(wire, 0), 0, tokens, HEADS, block_t=b
            )
        )
        out[block_t] = 2 * nbytes / ms / 1e6
    return out


def main() -> int:
    """Check, then benchmark; exit 1 on any correctness failure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="small sizes (the interpreter)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    began = time.perf_counter()
    layers, tokens = (2, 37) if args.tiny else (4, 4099)
    failures = check_kernels(device, layers, tokens)
    print(
        f"correctness ({device}): "
        + ("all kernels bit-exact" if not failures else f"FAILED {failures}"),
        file=sys.stderr,
    )
    if failures:
        return 1
    if args.check_only:
        return 0
    if device != "cuda" and not args.tiny:
        print("timing needs a CUDA device (or --tiny to exercise the script)", file=sys.stderr)
        return 2
    sizes = (
        [(2, 32), (2, 64)]
        if args.tiny
        else [
            (layers, tokens) for layers in (32, 64) for tokens in (1024, 4096, 16384, 65536, 131072)
        ]
    )
    rows = []
    for layers, tokens in sizes:
        rows.append(bench_row(layers, tokens, device))
        # Progress on stderr, so that a run cut off by a time limit still shows its rows.
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    sweep = sweep_block_t(*((2, 32) if args.tiny else (32, 16384)), device)
    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
        "rows": rows,
        "block_t_sweep_gbps": sweep,
        "seconds": time.perf_counter() - began,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['device']}, bf16, {HEADS} KV heads, head_dim {HEAD_DIM}, blocks of {BLOCK}")
    print(
        f"{'layers':>6} {'tokens':>7} {'GB':>6} {'copy GB/s':>10} {'gather':>8} {'x copy':>7} "
        f"{'x torch':>7} {'scatter':>8} {'x copy':>7} {'x torch':>7} {'remap':>8} {'x copy':>7}"
    )
    for r in rows:
        print(
            f"{r['layers']:>6} {r['tokens']:>7} {r['bytes'] / 1e9:>6.2f} "  # type: ignore[operator]
            + " ".join(
                _fmt(r[key], width, digits)
                for key, width, digits in (
                    ("copy_gbps", 10, 0),
                    ("gather_gbps", 8, 0),
                    ("gather_vs_copy", 7, 2),
                    ("gather_vs_torch", 7, 1),
                    ("scatter_gbps", 8, 0),
                    ("scatter_vs_copy", 7, 2),
                    ("scatter_vs_torch", 7, 1),
                    ("remap_gbps", 8, 0),
                    ("remap_vs_copy", 7, 2),
                )
            )
        )
    print(
        "gather GB/s by BLOCK_T (32 layers, 16k tokens): "
        + ", ".join(f"{k}: {v:.0f}" for k, v in sweep.items())
    )
    print(f"total {report['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
