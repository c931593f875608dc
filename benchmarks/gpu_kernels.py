"""GPU benchmark of the cell-copy kernels: device time and end-to-end call time.

One command on a CUDA machine with torch and Triton (Mooncake is not needed):

    python benchmarks/gpu_kernels.py           # default subset, stops starting work at 480 s
    python benchmarks/gpu_kernels.py --full    # the whole size grid, no deadline by default
    python benchmarks/gpu_kernels.py --json    # one JSON object {"rows", ...}

It only times. What it times is checked first, bit for bit on poisoned memory, by the `cuda`
tests: `pytest -m cuda tests/kernels` (tests/kernels/test_cuda_kernels.py: every implementation
timed here against the torch twin for each kernel variant of the grid, and `kvxfer.reshard`
end to end on the device; scripts/gpu_vllm_e2e.sh runs them before anything else).

Caches: paged, NHD/kv_first, blocks of 16 tokens in a scattered block table, 8 KV heads; the
last `n` heads are moved (a rank pair's slice), all tokens of the request. Ops: pack
(`gather_kv`: cache -> wire buffer `[layers, 2, tokens, n, head_dim]`), unpack (`scatter_kv`:
wire -> cache), remap N>H and remap H>N (`remap_kv`: NHD cache <-> HND cache, blocks of 16 on
both sides). MLA caches (`[blocks, 16, 576]`): pack and unpack. Sizes: 32 and 80 layers,
1k-128k tokens, 8/4/2/1 of 8 heads moved, head_dim 64/128/256, bf16 and fp8, MLA 576
(`--full`; by default a subset, see `default_grid`). Rows that do not fit in free device
memory are reported as skipped.

Converting rows (`conversion`, e.g. "bfloat16->float8_e4m3fn"; docs/kernels-and-layouts.md,
"Dtype conversion"): a bf16 cache and an fp8 e4m3 wire buffer, with a scale per layer and
plane; pack quantizes (`bfloat16->float8_e4m3fn`: a prefill's pack), unpack dequantizes
(`float8_e4m3fn->bfloat16`: a decode's unpack). Their `bytes_moved` are the destination's, the
copy baseline copies the destination's bytes, and GB/s counts the bytes read (the source's) plus
the bytes written; the index and block baselines do not convert (skipped).

Device time: CUDA events around one launch, on the device only, `--reps` times (default 25),
after a warm-up launch (compilation). Before each repetition, outside the events, a 256 MiB
buffer is written (flushes the L2: 50 MB on H100, 60 MB on H200) and the stream is held busy
for about 100 us, so the host's launch overhead stays hidden. Host preparation happens once,
before: the new kernel is timed through `prepare_cell_copy(...).launch()`, or through
`copy_cells` (host work included) while kvxfer.kernels has no `prepare_cell_copy` (the report's
`new_device_timing` says which). End-to-end call time, separately: host wall time from the call
to `torch.cuda.synchronize()` returning, L2 flushed before each call; of the public call
(`gather_kv`, `scatter_kv`, `remap_kv`) and of the torch twin.

Columns (JSON: each row's `device` and `e2e` hold median_ms, p10_ms, p90_ms, reps; device
times also gbps and vs_copy):
- op, layers, tokens, heads (moved/of the layer), dim, dtype, MB: `bytes_moved` = layers x
  planes x tokens x heads moved x head_dim x itemsize.
- copy GB/s: `Tensor.copy_` of `bytes_moved` contiguous bytes (one cudaMemcpyAsync), measured
  in the same run: the reference. "x copy" = copy's median / the op's median; GB/s counts
  bytes read once plus bytes written once (2 x bytes_moved / median, or the source's plus the
  destination's bytes for a conversion), for every column.
- new ms [p10-p90], GB/s, x copy: the new kernel's device time, median [10th-90th percentile].
- index: torch, one pass per layer: `index_select(..., out=wire)` (pack) or `index_copy_` from
  the wire (unpack), on rows of int64 words, indices built beforehand; a remap has no one-pass
  form (neither side is dense): `index_select` into a temporary, then `index_copy_`. x copy.
- block: one `copy_` per (layer, plane, block), as vLLM's `swap_blocks` issues one
  cudaMemcpyAsync per block; here a Python loop of tensor copies over slices built beforehand,
  a memcpy where the block's moved cells are contiguous on both sides (all heads, NHD), else
  a strided copy kernel (head slices, NHD<->HND). "skip" above `--max-block-copies` copies per
  call (the loop is launch-bound). x copy.
- e2e new, torch: end-to-end call time, median ms.
- target (H100/H200): pack and unpack at least 0.85 x copy from 4k tokens, remaps at least
  0.7; "ok" or "MISS" from 4k tokens on, blank below. A summary per op follows the table.

`--deadline-s` (default 480, none with `--full`) counts from the start: past it no measurement
starts and the partial table is printed. SIGTERM and Ctrl-C print the partial table too (exit
status 130), else the exit status is 0.

`--tiny` runs all of it at toy sizes. Without CUDA it needs TRITON_INTERPRET=1 (the Triton
interpreter on CPU tensors; timed with perf_counter, the numbers mean nothing): the test suite
runs it (tests/benchmarks/test_gpu_benchmark_script.py) so the script cannot rot.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import triton

import kvxfer.kernels as kernels
from kvxfer.kernels import KVBuffer, canonical_kv_view, wire_kv_buffer
from kvxfer.testing.results import Benchmark

BENCHMARK = Benchmark(
    name="gpu_kernels",
    title="pack, unpack and remap against a device copy of the same bytes",
    command="python3 benchmarks/gpu_kernels.py",
    results_dir=Path(__file__).resolve().parent / "results",
)
HEADS = 8  # KV heads per layer of every timed cache
BLOCK = 16  # tokens per block of every timed cache
POISON = 0xA5
FLUSH_BYTES = 256 << 20  # more than any L2 (H100: 50 MB, H200: 60 MB)
SPIN_CYCLES = 200_000  # about 100 us at 2 GHz: the stream stays busy while the host launches
TARGET_FROM_TOKENS = 4096
TARGETS = {"pack": 0.85, "unpack": 0.85, "remap_nhd_to_hnd": 0.7, "remap_hnd_to_nhd": 0.7}
KV_OPS = ("pack", "unpack", "remap_nhd_to_hnd", "remap_hnd_to_nhd")
MLA_OPS = ("pack", "unpack")
OP_LABELS = {
    "pack": "pack",
    "unpack": "unpack",
    "remap_nhd_to_hnd": "remap N>H",
    "remap_hnd_to_nhd": "remap H>N",
}
BF16, FP8 = "bfloat16", "float8_e4m3fn"
DTYPES = {BF16: torch.bfloat16, FP8: torch.float8_e4m3fn}
# A converting geometry's scales: one per (layer, plane), distinct (`conversion_scales`).
SCALE_BASE, SCALE_STEP = 0.5, 0.125
SHORT_DTYPE = {BF16: "bf16", FP8: "fp8"}
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_RANDOM_RANGE = {1: (0, 256), 2: (-(1 << 15), 1 << 15)}


Launch = Callable[[], object]
_SEEDS = itertools.count(1)


class Skipped(Exception):
    """A measurement or check that does not apply here, with the reason."""


class Stopped(Exception):
    """The deadline passed, or the run was interrupted."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


# ---------------------------------------------------------------------------------------------
# Geometries and buffers


@dataclass(frozen=True)
class Geometry:
    """One request's cells: every layer, `tokens` tokens, `heads_moved` of `HEADS` heads."""

    layers: int
    tokens: int
    head_dim: int
    dtype: str
    heads_moved: int = HEADS
    mla: bool = False
    wire_dtype: str | None = None  # a converting geometry: the wire's dtype (the cache's: dtype)

    def __post_init__(self) -> None:
        if not 1 <= self.heads_moved <= self.heads:
            raise ValueError(f"heads_moved: {self.heads_moved} of {self.heads} heads")

    @property
    def heads(self) -> int:
        return 1 if self.mla else HEADS

    @property
    def planes(self) -> int:
        return 1 if self.mla else 2

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return torch.empty(0, dtype=self.torch_dtype).element_size()

    @property
    def wire_torch_dtype(self) -> torch.dtype:
        """The wire buffer's dtype: the cache's, or another one that the copies convert to."""
        return DTYPES[self.wire_dtype or self.dtype]

    def conversion(self, op: str) -> str | None:
        """`SRC->DST` of a converting op (pack: cache -> wire; unpack: wire -> cache)."""
        if self.wire_dtype is None:
            return None
        return (
            f"{self.dtype}->{self.wire_dtype}"
            if op == "pack"
            else f"{self.wire_dtype}->{self.dtype}"
        )

    def wire_bytes(self) -> int:
        """The moved cells' bytes in the wire's dtype."""
        return self.moved_bytes() * self.wire_torch_dtype.itemsize // self.itemsize

    @property
    def ops(self) -> tuple[str, ...]:
        return MLA_OPS if self.mla or self.wire_dtype else KV_OPS

    @property
    def head_offset(self) -> int:
        """The moved heads are the cache's last `heads_moved` (a rank pair's slice)."""
        return self.heads - self.heads_moved

    def moved_bytes(self) -> int:
        cells = self.layers * self.planes * self.tokens * self.heads_moved
        return cells * self.head_dim * self.itemsize

    def cache_bytes(self, block: int = BLOCK) -> int:
        blocks = -(-self.tokens // block)
        cells = self.layers * self.planes * blocks * block * self.heads * self.head_dim
        return cells * self.itemsize

    def kernel_variant(self) -> tuple[int, str, int, bool, str | None]:
        """What decides the compiled kernel: checked once per variant."""
        return (self.head_dim, self.dtype, self.heads_moved, self.mla, self.wire_dtype)

    def describe(self) -> dict[str, Any]:
        return {
            "layers": self.layers,
            "tokens": self.tokens,
            "heads_moved": self.heads_moved,
            "heads": self.heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "mla": self.mla,
            "wire_dtype": self.wire_dtype,
        }


def default_grid() -> list[Geometry]:
    """The subset run by default: the main sweep first, so a deadline cuts the variants."""
    grid = [Geometry(32, t, 128, BF16) for t in (1024, 4096, 16384, 65536, 131072)]
    grid += [Geometry(32, 16384, 128, BF16, heads_moved=n) for n in (4, 2, 1)]
    grid += [Geometry(32, 16384, d, BF16) for d in (64, 256)]
    grid += [Geometry(32, t, 128, FP8) for t in (4096, 65536)]
    grid += [Geometry(32, 16384, 128, FP8, heads_moved=1)]
    grid += [Geometry(32, t, 576, BF16, heads_moved=1, mla=True) for t in (4096, 65536)]
    grid += [Geometry(32, 16384, 576, FP8, heads_moved=1, mla=True)]
    grid += [Geometry(32, t, 128, BF16, wire_dtype=FP8) for t in (4096, 65536)]
    grid += [Geometry(32, 16384, 576, BF16, heads_moved=1, mla=True, wire_dtype=FP8)]
    grid += [Geometry(80, t, 128, BF16) for t in (4096, 32768, 131072)]
    return grid


def full_grid() -> list[Geometry]:
    """32 and 80 layers, 1k-128k tokens, 8/4/2/1 heads moved, head_dim 64/128/256, bf16 and
    fp8, and MLA 576; by size, so that a deadline cuts the largest."""
    grid = []
    for tokens, layers in itertools.product((1024, 4096, 16384, 32768, 65536, 131072), (32, 80)):
        for dtype in (BF16, FP8):
            for head_dim, heads_moved in itertools.product((64, 128, 256), (8, 4, 2, 1)):
                grid.append(Geometry(layers, tokens, head_dim, dtype, heads_moved))
            grid.append(Geometry(layers, tokens, 576, dtype, heads_moved=1, mla=True))
        grid.append(Geometry(layers, tokens, 128, BF16, wire_dtype=FP8))
        grid.append(Geometry(layers, tokens, 576, BF16, heads_moved=1, mla=True, wire_dtype=FP8))
    return grid


def tiny_grid() -> list[Geometry]:
    """Toy sizes for the interpreter: every code path, one of each kind."""
    return [
        Geometry(2, 32, 16, BF16),
        Geometry(2, 48, 16, FP8, heads_moved=2),
        Geometry(2, 32, 576, BF16, heads_moved=1, mla=True),
        Geometry(2, 32, 16, BF16, heads_moved=2, wire_dtype=FP8),
        Geometry(2, 32, 576, BF16, heads_moved=1, mla=True, wire_dtype=FP8),
    ]


def int_view(t: torch.Tensor) -> torch.Tensor:
    """The same memory as integers of the element's width (bits, no float semantics)."""
    return t.view(_WORDS[t.element_size()])


def poison(t: torch.Tensor) -> None:
    t.view(torch.uint8).fill_(POISON)


def fill_random(t: torch.Tensor, gen: torch.Generator) -> None:
    """Random bit patterns (every sign and exponent), generated on the tensor's device."""
    words = t.view(torch.int16) if t.element_size() % 2 == 0 else t.view(torch.uint8)
    low, high = _RANDOM_RANGE[words.element_size()]
    words.random_(low, high, generator=gen)


def make_cache(
    g: Geometry,
    device: torch.device,
    gen: torch.Generator,
    *,
    layout: str = "NHD",
    block: int = BLOCK,
    head_offset: int = 0,
    spare_blocks: int = 0,
) -> KVBuffer:
    """A paged kv_first cache whose scattered block table holds `g.tokens` tokens."""
    needed = -(-g.tokens // block)
    num_blocks = needed + spare_blocks
    if g.mla:
        shape: tuple[int, ...] = (num_blocks, block, g.head_dim)
    elif layout == "NHD":
        shape = (2, num_blocks, block, g.heads, g.head_dim)
    else:
        shape = (2, num_blocks, g.heads, block, g.head_dim)
    layers = []
    for _ in range(g.layers):
        layers.append(torch.empty(shape, dtype=g.torch_dtype, device=device))
        fill_random(layers[-1], gen)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(next(_SEEDS)))
    ids = order[:needed].to(device)
    return KVBuffer(layers, layout, "kv_first", g.mla, ids, 0, head_offset)


def make_wire(g: Geometry, device: torch.device, token_start: int = 0) -> torch.Tensor:
    """A poisoned wire buffer for tokens `[token_start, g.tokens)`, in the wire's dtype."""
    n = g.tokens - token_start
    if g.mla:
        shape: tuple[int, ...] = (g.layers, n, g.head_dim)
    else:
        shape = (g.layers, 2, n, g.heads_moved, g.head_dim)
    wire = torch.empty(shape, dtype=g.wire_torch_dtype, device=device)
    poison(wire)
    return wire


@dataclass
class CellCopyCase:
    """One op of one geometry: the buffers, the range, and the calls that perform it."""

    op: str
    src: KVBuffer
    dst: KVBuffer
    token_start: int
    token_end: int
    num_heads: int
    public: Callable[..., None]  # with the scales bound, where it converts
    torch_twin: Callable[..., None]
    scales: torch.Tensor | None = None  # a converting copy's: [layers, planes] float32

    @property
    def args(self) -> tuple[KVBuffer, KVBuffer, int, int, int]:
        return self.src, self.dst, self.token_start, self.token_end, self.num_heads

    def check_no_conversion(self, what: str) -> None:
        """Skip an implementation that only copies bits, for a converting case."""
        if self.scales is not None:
            raise Skipped(f"{what} does not convert dtypes")


def conversion_scales(g: Geometry, device: torch.device) -> torch.Tensor:
    """Distinct scales per (layer, plane), as a calibrated vLLM checkpoint gives them."""
    count = g.layers * g.planes
    steps = torch.arange(count, dtype=torch.float32) * SCALE_STEP + SCALE_BASE
    return steps.reshape(g.layers, g.planes).to(device)


def _case(
    op: str,
    src: KVBuffer,
    dst: KVBuffer,
    start: int,
    end: int,
    n: int,
    scales: torch.Tensor | None = None,
) -> CellCopyCase:
    public, twin = {
        "pack": (kernels.gather_kv, kernels.gather_kv_torch),
        "unpack": (kernels.scatter_kv, kernels.scatter_kv_torch),
    }.get(op, (kernels.remap_kv, kernels.remap_kv_torch))
    if scales is not None:
        public = functools.partial(public, scales=scales)
        twin = functools.partial(twin, scales=scales)
    return CellCopyCase(op, src, dst, start, end, n, public, twin, scales)


# ---------------------------------------------------------------------------------------------
# The implementations compared: each returns a launch with its host preparation done.


def prepare_new(case: CellCopyCase) -> Launch:
    """The new kernel's launch alone when the API offers it, else its whole call."""
    prepare = getattr(kernels, "prepare_cell_copy", None)
    if prepare is not None:
        return prepare(*case.args, scales=case.scales).launch
    return lambda: kernels.copy_cells(*case.args, scales=case.scales)


def new_timing_method() -> str:
    if hasattr(kernels, "prepare_cell_copy"):
        return "prepare_cell_copy(...).launch()"
    return "copy_cells(...): host preparation included (no prepare_cell_copy in kvxfer.kernels)"


def _canonical(buf: KVBuffer, t: torch.Tensor) -> torch.Tensor:
    return canonical_kv_view(t, buf.layout, buf.kv_placement, buf.mla)


def _cell_offsets(buf: KVBuffer, tokens: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Element offset, from the start of a layer tensor, of every moved cell: [planes,
    tokens, heads]."""
    view = _canonical(buf, buf.layers[0])
    planes, _, block_size, _, _ = view.shape
    s_plane, s_block, s_slot, s_head, _ = view.stride()
    pos = tokens - buf.token_shift
    logical = torch.div(pos, block_size, rounding_mode="floor")
    block = logical if buf.block_ids is None else buf.block_ids[logical]
    slot = pos - logical * block_size
    heads = buf.head_offset + torch.arange(num_heads, device=tokens.device)
    return (
        (torch.arange(planes, device=tokens.device) * s_plane)[:, None, None]
        + (block * s_block + slot * s_slot)[None, :, None]
        + (heads * s_head)[None, None, :]
    )


def _rows(t: torch.Tensor, words: torch.dtype, length: int, step: int) -> torch.Tensor:
    """Windows of `length` words every `step` words over a contiguous layer tensor."""
    if not t.is_contiguous():
        raise Skipped("index baseline: a layer tensor is not contiguous")
    flat = t.reshape(-1).view(torch.uint8).view(words)
    return flat.as_strided(((flat.numel() - length) // step + 1, length), (step, 1))


def _first_of_run(rows: torch.Tensor) -> int | None:
    first = int(rows[0])
    expected = torch.arange(first, first + rows.numel(), device=rows.device)
    return first if torch.equal(rows, expected) else None


def prepare_index_copy(case: CellCopyCase) -> Launch:
    """Per layer, one `index_select` into the dense side (pack), one `index_copy_` from it
    (unpack), or both through a temporary (remap); rows of int64 where the cell allows."""
    case.check_no_conversion("the index baseline")
    src, dst, start, end, n = case.args
    device = src.layers[0].device
    tokens = torch.arange(start, end, device=device)
    src_off, dst_off = _cell_offsets(src, tokens, n), _cell_offsets(dst, tokens, n)
    src_view, dst_view = _canonical(src, src.layers[0]), _canonical(dst, dst.layers[0])
    head_dim, itemsize = src_view.shape[4], src_view.element_size()
    unit = head_dim
    # A token's moved heads side by side on both sides (NHD, the wire): one row per token.
    if (
        n > 1
        and src_view.stride(3) == head_dim == dst_view.stride(3)
        and bool((dst_off[..., 0] % (n * head_dim) == 0).all())
    ):
        unit, src_off, dst_off = n * head_dim, src_off[..., 0], dst_off[..., 0]
    src_step = unit if bool((src_off % unit == 0).all()) else head_dim
    # The widest word dividing a head's bytes divides every offset (all are whole heads).
    word = next(w for w in (8, 4, 2, 1) if head_dim * itemsize % w == 0)
    unit_w, step_w = unit * itemsize // word, src_step * itemsize // word
    src_idx = (src_off // src_step).reshape(-1)
    dst_idx = (dst_off // unit).reshape(-1)
    dst_first, src_first = _first_of_run(dst_idx), _first_of_run(src_idx)
    count = dst_idx.numel()
    pairs = [
        (_rows(s, _WORDS[word], unit_w, step_w), _rows(d, _WORDS[word], unit_w, unit_w))
        for s, d in zip(src.layers, dst.layers, strict=True)
    ]
    if dst_first is not None:  # pack: straight into the dense wire buffer
        outs = [(reads, writes[dst_first : dst_first + count]) for reads, writes in pairs]

        def gather() -> None:
            for reads, out in outs:
                torch.index_select(reads, 0, src_idx, out=out)

        return gather
    if src_first is not None:  # unpack: straight from the dense wire buffer
        ins = [(reads[src_first : src_first + count], writes) for reads, writes in pairs]

        def scatter() -> None:
            for rows, writes in ins:
                writes.index_copy_(0, dst_idx, rows)

        return scatter
    temp = torch.empty((count, unit_w), dtype=_WORDS[word], device=device)

    def two_pass() -> None:
        for reads, writes in pairs:
            torch.index_select(reads, 0, src_idx, out=temp)
            writes.index_copy_(0, dst_idx, temp)

    return two_pass


def _pieces(buf: KVBuffer, start: int, end: int) -> list[int]:
    """Tokens where `buf` starts a new block within `[start, end)`."""
    block_size = _canonical(buf, buf.layers[0]).shape[2]
    first = start + (-(start - buf.token_shift)) % block_size
    return list(range(first, end, block_size))


def _locate(buf: KVBuffer, ids: list[int] | None, token: int) -> tuple[int, int]:
    block_size = _canonical(buf, buf.layers[0]).shape[2]
    logical, slot = divmod(token - buf.token_shift, block_size)
    return (logical if ids is None else ids[logical]), slot


def prepare_block_copies(case: CellCopyCase, max_copies: int) -> Launch:
    """One `copy_` per (layer, plane, run of tokens within one block on both sides)."""
    case.check_no_conversion("the per-block baseline")
    src, dst, start, end, n = case.args
    bounds = sorted({start, end, *_pieces(src, start, end), *_pieces(dst, start, end)})
    runs = list(itertools.pairwise(bounds))
    planes = _canonical(src, src.layers[0]).shape[0]
    copies = len(src.layers) * planes * len(runs)
    if copies > max_copies:
        raise Skipped(f"{copies:,} copies per call > --max-block-copies {max_copies:,}")
    src_ids = None if src.block_ids is None else src.block_ids.tolist()
    dst_ids = None if dst.block_ids is None else dst.block_ids.tolist()
    located = [(_locate(src, src_ids, a), _locate(dst, dst_ids, a), b - a) for a, b in runs]
    pairs = []
    for s_layer, d_layer in zip(src.layers, dst.layers, strict=True):
        s_view, d_view = _canonical(src, int_view(s_layer)), _canonical(dst, int_view(d_layer))
        hs, hd = src.head_offset, dst.head_offset
        for plane in range(planes):
            for (sb, ss), (db, ds), length in located:
                pairs.append(
                    (
                        d_view[plane, db, ds : ds + length, hd : hd + n],
                        s_view[plane, sb, ss : ss + length, hs : hs + n],
                    )
                )

    def run() -> None:
        for d, s in pairs:
            d.copy_(s)

    return run


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# Timing


def _percentiles(samples: list[float]) -> dict[str, Any]:
    p10, median, p90 = np.percentile(samples, [10, 50, 90]).tolist()
    return {"median_ms": median, "p10_ms": p10, "p90_ms": p90, "reps": len(samples)}


class Timer:
    """Device time with CUDA events (L2 flushed), end-to-end call time, and the deadline."""

    def __init__(self, device: torch.device, reps: int, deadline: float | None) -> None:
        self.device = device
        self.reps = reps
        self.deadline = deadline
        self.cuda = device.type == "cuda"
        self.flush = (
            torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if self.cuda else None
        )
        self._sleep = getattr(torch.cuda, "_sleep", None)

    def check_deadline(self) -> None:
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise Stopped("deadline (--deadline-s) passed")

    def _prepare_rep(self, rep: int) -> None:
        assert self.flush is not None
        self.flush.fill_(rep & 0xFF)

    def device_time(self, launch: Launch) -> dict[str, Any]:
        """`reps` launches, each alone between two events, after a warm-up launch."""
        self.check_deadline()
        launch()
        _sync(self.device)
        if not self.cuda:  # the interpreter: exercises the script, times mean nothing
            return self._wall(launch)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for rep in range(self.reps):
            self._prepare_rep(rep)
            if self._sleep is not None:
                self._sleep(SPIN_CYCLES)
            starts[rep].record()
            launch()
            ends[rep].record()
        torch.cuda.synchronize()
        return _percentiles([s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)])

    def call_time(self, call: Launch) -> dict[str, Any]:
        """Host wall time from the call to its completion on the device, after a warm-up."""
        self.check_deadline()
        call()
        _sync(self.device)
        return self._wall(call)

    def _wall(self, call: Launch) -> dict[str, Any]:
        samples = []
        for rep in range(self.reps):
            if self.cuda:
                self._prepare_rep(rep)
                torch.cuda.synchronize()
            began = time.perf_counter()
            call()
            _sync(self.device)
            samples.append((time.perf_counter() - began) * 1e3)
        return _percentiles(samples)


def _measure(fn: Callable[[], dict[str, Any]], device: torch.device) -> dict[str, Any]:
    """One measurement; a skip, an out-of-memory or an error becomes the cell's reason."""
    try:
        return fn()
    except Skipped as why:
        return {"skipped": str(why)}
    except torch.OutOfMemoryError:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {"skipped": "out of device memory"}
    except (Stopped, KeyboardInterrupt):
        raise
    except Exception as exc:  # reported in its cell; the table goes on
        return {"skipped": f"error: {type(exc).__name__}: {exc}"}


def _free_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def _needs(device: torch.device, nbytes: int) -> None:
    free = _free_bytes(device)
    # Index tensors, block tables and the allocator's rounding: 5% and 1 GiB of headroom.
    if free is not None and nbytes * 1.05 + (1 << 30) > free:
        raise Skipped(f"needs {nbytes / 1e9:.1f} GB, {free / 1e9:.1f} GB free")


def time_case(
    case: CellCopyCase, g: Geometry, timer: Timer, copy: dict[str, Any], max_copies: int
) -> dict[str, Any]:
    """One row: the op's device time by implementation, and end-to-end call times."""
    nbytes = g.moved_bytes()
    conversion = g.conversion(case.op)
    read = written = nbytes
    if conversion is not None:  # the destination's bytes, and the source's read
        read, written = (nbytes, g.wire_bytes()) if case.op == "pack" else (g.wire_bytes(), nbytes)
    dev = timer.device
    device_times = {
        "copy": copy,
        "new": _measure(lambda: timer.device_time(prepare_new(case)), dev),
        "index_select": _measure(lambda: timer.device_time(prepare_index_copy(case)), dev),
        "per_block": _measure(
            lambda: timer.device_time(prepare_block_copies(case, max_copies)), dev
        ),
    }
    copy_ms = copy.get("median_ms")
    for stats in device_times.values():
        if "median_ms" in stats:
            stats["gbps"] = (read + written) / stats["median_ms"] / 1e6
            stats["vs_copy"] = None if copy_ms is None else copy_ms / stats["median_ms"]
    e2e = {
        "new": _measure(lambda: timer.call_time(lambda: case.public(*case.args)), dev),
        "torch": _measure(lambda: timer.call_time(lambda: case.torch_twin(*case.args)), dev),
    }
    target = TARGETS[case.op] if g.tokens >= TARGET_FROM_TOKENS else None
    ratio = device_times["new"].get("vs_copy")
    return {
        "op": case.op,
        **g.describe(),
        "conversion": conversion,
        "bytes_moved": written,
        "device": device_times,
        "e2e": e2e,
        "target_vs_copy": target,
        "meets_target": None if target is None or ratio is None else ratio >= target,
    }


def time_geometry(
    g: Geometry, timer: Timer, max_copies: int, emit: Callable[[dict[str, Any]], None]
) -> None:
    """Every op of `g`, allocating in phases so that the peak is two caches' worth (the
    remaps), never more: the copy baseline (wire + a copy of it), pack and unpack (cache +
    wire), the remaps (NHD cache + HND cache). What does not fit is reported as skipped."""
    device, moved = timer.device, g.moved_bytes()
    gen = torch.Generator(device=device).manual_seed(g.tokens)
    done: set[str] = set()

    def row(case: CellCopyCase, copy: dict[str, Any]) -> None:
        emit(time_case(case, g, timer, copy, max_copies))
        done.add(case.op)

    try:
        _needs(device, 2 * moved)
        wire = make_wire(g, device)
        copy = _time_copy(wire, timer)
        # A conversion's unpack writes the cache's bytes: its copy baseline is of those.
        unpack_copy = copy
        if g.wire_dtype is not None:
            unpack_copy = _time_copy(torch.empty(moved, dtype=torch.uint8, device=device), timer)
        scales = conversion_scales(g, device) if g.wire_dtype is not None else None
        _needs(device, g.cache_bytes())
        nhd = make_cache(g, device, gen, head_offset=g.head_offset)
        wire_buf = wire_kv_buffer(wire, 0, g.mla)
        row(_case("pack", nhd, wire_buf, 0, g.tokens, g.heads_moved, scales), copy)
        row(_case("unpack", wire_buf, nhd, 0, g.tokens, g.heads_moved, scales), unpack_copy)
        del wire, wire_buf
        if "remap_nhd_to_hnd" in g.ops:  # not MLA, not a conversion (pack and unpack only)
            _needs(device, g.cache_bytes())
            hnd = make_cache(g, device, gen, layout="HND")
            row(_case("remap_nhd_to_hnd", nhd, hnd, 0, g.tokens, g.heads_moved), copy)
            row(_case("remap_hnd_to_nhd", hnd, nhd, 0, g.tokens, g.heads_moved), copy)
    except (Skipped, torch.OutOfMemoryError) as why:
        reason = str(why) if isinstance(why, Skipped) else "out of device memory"
        for op in g.ops:
            if op not in done:
                emit(
                    {"op": op, **g.describe(), "conversion": g.conversion(op),
                     "bytes_moved": moved, "skipped": reason}
                )  # fmt: skip


def _time_copy(wire: torch.Tensor, timer: Timer) -> dict[str, Any]:
    """`copy_` of the wire buffer's bytes into a buffer of the same size (freed after)."""
    src = wire.view(-1).view(torch.uint8)
    dst = torch.empty_like(src)
    copy = _measure(lambda: timer.device_time(lambda: dst.copy_(src)), timer.device)
    if "median_ms" in copy:
        copy.update(gbps=2 * src.numel() / copy["median_ms"] / 1e6, vs_copy=1.0)
    return copy


# ---------------------------------------------------------------------------------------------
# Report


def _label(g: Geometry) -> str:
    heads = "MLA" if g.mla else f"{g.heads_moved}/{g.heads} heads"
    wire = f"<>{SHORT_DTYPE[g.wire_dtype]}" if g.wire_dtype else ""
    return f"{g.layers}L {g.tokens}t {heads} d{g.head_dim} {SHORT_DTYPE[g.dtype]}{wire}"


def _dtype_cell(r: dict[str, Any]) -> str:
    """A row's dtype, or its conversion as `bf16>fp8`."""
    conversion = r.get("conversion")
    if not conversion:
        return SHORT_DTYPE[r["dtype"]]
    src, dst = conversion.split("->")
    return f"{SHORT_DTYPE[src]}>{SHORT_DTYPE[dst]}"


def _num(value: object, width: int, digits: int) -> str:
    if value is None:
        return f"{'-':>{width}}"
    return f"{value:>{width},.{digits}f}"


def _cell(stats: dict[str, Any] | None, key: str, width: int, digits: int) -> str:
    if stats is None:
        return f"{'-':>{width}}"
    if "skipped" in stats:
        return f"{'skip':>{width}}"
    value = stats.get(key)
    # Ratios of interpreted runs can be huge; keep the column's width.
    return _num(value, width, digits if value is None or value < 10 ** (width - 3) else 0)


_HEADER = (
    f"{'op':<9} {'layers':>6} {'tokens':>7} {'heads':>5} {'dim':>4} {'dtype':>8} {'MB':>8} "
    f"| {'copy GB/s':>9} | {'new ms':>8} {'[p10-p90]':>17} {'GB/s':>6} {'x copy':>6} "
    f"| {'index':>5} {'block':>5} | {'e2e new':>8} {'torch':>8} "
    f"| target"
)


def format_row(r: dict[str, Any]) -> str:
    """One line of the table (the columns of `_HEADER`)."""
    heads = "MLA" if r["mla"] else f"{r['heads_moved']}/{r['heads']}"
    head = (
        f"{OP_LABELS[r['op']]:<9} {r['layers']:>6} {r['tokens']:>7} {heads:>5} "
        f"{r['head_dim']:>4} {_dtype_cell(r):>8} {r['bytes_moved'] / 1e6:>8,.1f}"
    )
    if "skipped" in r:
        return head + f"| skipped: {r['skipped']}"
    dev, e2e = r["device"], r["e2e"]
    new = dev["new"]
    spread = f"[{new['p10_ms']:.3f}-{new['p90_ms']:.3f}]" if "median_ms" in new else "skip"
    target = r["target_vs_copy"]
    verdict = "" if target is None else f">={target:.2f} {'ok' if r['meets_target'] else 'MISS'}"
    cells = [
        head,
        "|",
        _cell(dev["copy"], "gbps", 9, 0),
        "|",
        _cell(new, "median_ms", 8, 3),
        f"{spread:>17}",
        _cell(new, "gbps", 6, 0),
        _cell(new, "vs_copy", 6, 2),
        "|",
        *(_cell(dev[k], "vs_copy", 5, 2) for k in ("index_select", "per_block")),
        "|",
        *(_cell(e2e[k], "median_ms", 8, 3) for k in ("new", "torch")),
        "|",
        verdict,
    ]
    return " ".join(cells)


def target_summary(rows: list[dict[str, Any]]) -> list[str]:
    """Per op (and per conversion): the new kernel's range of x copy from 4k tokens, against
    its target."""
    lines = []
    conversions = sorted({r.get("conversion") or "" for r in rows})
    for (op, target), conversion in itertools.product(TARGETS.items(), conversions):
        ratios = [
            r["device"]["new"]["vs_copy"]
            for r in rows
            if r["op"] == op
            and (r.get("conversion") or "") == conversion
            and r.get("target_vs_copy")
            and r["device"]["new"].get("vs_copy")
        ]
        if ratios:
            met = "met" if min(ratios) >= target else "NOT met"
            name = f"{OP_LABELS[op]} {conversion}".strip()
            lines.append(
                f"{name}: {min(ratios):.2f}-{max(ratios):.2f} of copy over "
                f"{len(ratios)} rows from {TARGET_FROM_TOKENS} tokens; target {target}: {met}"
            )
    return lines


def figure(report: dict[str, Any]) -> tuple[str, str]:
    """The results page's figure and targets: `target_summary`'s lines, one verdict."""
    summary = target_summary(report["rows"])
    verdict = "met" if all(line.endswith(": met") for line in summary) else "not met"
    text = "; ".join(summary) or "no row from 4k tokens"
    return text, f"pack and unpack ≥ 0.85 of a copy, remaps ≥ 0.7 ({verdict})"


def print_table(report: dict[str, Any]) -> None:
    rows = report["rows"]
    flushed = "L2 flushed" if report["flush_bytes"] else "interpreted, times meaningless"
    print(
        f"{report['device']} · torch {report['torch']} · Triton {report['triton']} · "
        f"{report['reps']} reps, {flushed} · GB/s = (bytes read + bytes written) / median"
    )
    print(f"new kernel device time: {report['new_device_timing']}")
    if rows:
        print(_HEADER)
        for r in rows:
            print(format_row(r))
        for line in target_summary(rows):
            print(line)
    if report["stopped"]:
        print(f"stopped early: {report['stopped']}")
    print(f"total {report['seconds']:.0f} s")


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Time every geometry of the grid; exit 130 when interrupted, else 0."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="toy sizes (the interpreter on CPU)")
    parser.add_argument("--full", action="store_true", help="the whole size grid")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 25)")
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="start no measurement after this many seconds from the start (default 480, "
        "none with --full); 0: no deadline",
    )
    parser.add_argument(
        "--max-block-copies",
        type=int,
        default=16384,
        help="skip the per-block baseline above this many copies per call",
    )
    BENCHMARK.add_record_flag(parser)
    args = parser.parse_args(argv)
    began = time.perf_counter()
    signal.signal(signal.SIGTERM, _on_sigterm)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print(
            "no CUDA device: run with --tiny and TRITON_INTERPRET=1 (the Triton interpreter)",
            file=sys.stderr,
        )
        return 2
    if device.type == "cpu" and not args.tiny:
        print("timing needs a CUDA device (or --tiny to exercise the script)", file=sys.stderr)
        return 2
    reps = args.reps or (3 if args.tiny else 25)
    grid = tiny_grid() if args.tiny else full_grid() if args.full else default_grid()
    interrupted = False
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "interpreted": os.environ.get("TRITON_INTERPRET") == "1",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "reps": reps,
        "flush_bytes": FLUSH_BYTES if device.type == "cuda" else 0,
        "gbps_counts": "bytes read + bytes written (2 x bytes_moved without a conversion)",
        "new_device_timing": new_timing_method(),
        "rows": [],
        "stopped": None,
    }
    try:
        limit = args.deadline_s if args.deadline_s is not None else 0 if args.full else 480
        deadline = began + limit if limit > 0 else None
        timer = Timer(device, reps, deadline)

        def emit(row: dict[str, Any]) -> None:
            report["rows"].append(row)
            # Progress on stderr, so that a run cut off still shows its rows.
            print(format_row(row), file=sys.stderr, flush=True)

        for g in grid:
            time_geometry(g, timer, args.max_block_copies, emit)
    except Stopped as why:
        report["stopped"] = str(why)
    except KeyboardInterrupt:
        report["stopped"] = "interrupted (SIGINT or SIGTERM)"
        interrupted = True
    report["seconds"] = time.perf_counter() - began
    if not (interrupted or report["interpreted"]):  # an interpreted run's times mean nothing
        note = f"stopped early: {report['stopped']}" if report["stopped"] else ""
        BENCHMARK.record(args.record, argv, report, figure, note)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_table(report)
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
