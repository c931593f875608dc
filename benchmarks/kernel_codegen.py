"""What the cell-copy kernel compiles to on a GPU, checked on a machine without one.

    python benchmarks/kernel_codegen.py            # a table
    python benchmarks/kernel_codegen.py --json     # {"rows": [{"config", "ld_bits", ...}]}
    python benchmarks/kernel_codegen.py --check    # exit 1 unless every aligned row is clean
    python benchmarks/kernel_codegen.py --record   # RESULTS.md's row

Every configuration the planner can produce (pack and unpack of NHD and HND caches, head
slices, remaps that change the block size, landing mirrors, MLA, fp8, kv_inner, and the
converting copies between two dtypes, named `SRC->DST`) is prepared by
`prepare_cell_copy` on small CPU tensors of the real geometry, exactly as a launch would be,
then compiled by Triton for sm_90 (Triton ships ptxas, so no GPU is needed). Each row reports:

- `ld_bits`, `st_bits`: the widest global load and store of cache data, in bits (128: 16-byte
  accesses). Index loads (block ids, layer addresses) are not data and are not counted.
- `registers`, `spill_bytes`: per thread, from `cuobjdump -res-usage` on the cubin.
- `div64`: whether the PTX divides or takes a remainder in 64 bits (a software routine).
- `aligned`: whether the host's alignment check passed, so the 16-byte variant was chosen.

`make test` runs `--json` (tests/kernels/test_kernel_codegen.py) and requires 128-bit accesses, no
spills and no 64-bit division on every row where `aligned` is true.

`specialization_key` gives Triton's cache key for a prepared launch, computed as Triton's own
launcher does; tests/kernels/test_kernel_variants.py uses it to show that warm-up and requests share
one compiled variant.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Fusing a multiply and an add into an FMA (Triton's default, set here only to silence Triton
# 3.9's warning) changes no result of the kernel: its one multiply-add, in the fp8 rounding of
# `kvxfer.kernels.convert`, multiplies by a power of two, which is exact.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import compute_cache_key, create_function_from_signature

from kvxfer.kernels import KVBuffer, StackedLayers, prepare_cell_copy, wire_kv_buffer
from kvxfer.kernels.convert import scale_mode
from kvxfer.kernels.copy_cells import CellCopyLaunch, _copy_cells_kernel
from kvxfer.layout import layer_shape
from kvxfer.testing.results import Benchmark

BENCHMARK = Benchmark(
    name="kernel_codegen",
    title="what the kernel compiles to for sm_90, on a CPU machine",
    command=".venv/bin/python benchmarks/kernel_codegen.py",
    results_dir=Path(__file__).resolve().parent / "results",
)
SM90 = GPUTarget("cuda", 90, 32)
_CUOBJDUMP = os.path.join(
    os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"
)


def _bind(launch: CellCopyLaunch, target: GPUTarget = SM90) -> tuple[list[Any], Any]:
    """(specialization, options) of a launch, as Triton's launcher computes them."""
    backend = make_backend(target)
    binder = create_function_from_signature(
        _copy_cells_kernel.signature, _copy_cells_kernel.params, backend
    )
    _, specialization, options = binder(**launch.arguments, num_warps=launch.num_warps)
    return specialization, backend.parse_options(options)


def specialization_key(launch: CellCopyLaunch, target: GPUTarget = SM90) -> str:
    """Triton's kernel-cache key for `launch`: equal keys share one compiled kernel."""
    specialization, options = _bind(launch, target)
    return compute_cache_key({}, specialization, options)


def compile_launch(launch: CellCopyLaunch, target: GPUTarget = SM90) -> Any:
    """Compile the variant `launch` would run, for `target`, without a GPU."""
    specialization, options = _bind(launch, target)
    names = [p.name for p in _copy_cells_kernel.params]
    signature = {n: s[0] for n, s in zip(names, specialization, strict=True)}
    constexprs = {
        n: s[1] for n, s in zip(names, specialization, strict=True) if s[0] == "constexpr"
    }
    attrs = {
        (i,): make_backend(target).parse_attr(s[1])
        for i, s in enumerate(specialization)
        if s[0] != "constexpr" and s[1]
    }
    source = ASTSource(
        fn=_copy_cells_kernel, signature=signature, constexprs=constexprs, attrs=attrs
    )
    return triton.compile(source, target=target, options={"num_warps": options.num_warps})


# A predicated global access of cache data: Triton guards masked loads and stores with `@%p`;
# the index loads (block id, layer address) are scalar and unguarded.
_ACCESS = re.compile(r"@%p\d+\s+(ld|st)\.global((?:\.\w+)*)")
_BITS = re.compile(r"\.(?:b|u|s|f)(\d+)$")
_DIV64 = re.compile(r"\b(?:div|rem)(?:\.full)?\.[su]64\b")


def data_access_bits(ptx: str) -> tuple[int, int]:
    """The widest guarded global load and store, in bits."""
    widest = {"ld": 0, "st": 0}
    for op, suffixes in _ACCESS.findall(ptx):
        parts = suffixes.split(".")
        lanes = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
        width = _BITS.search(suffixes)
        if width:
            widest[op] = max(widest[op], lanes * int(width.group(1)))
    return widest["ld"], widest["st"]


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, spill bytes) per thread of a compiled kernel, as `cuobjdump -res-usage`
    reports them: the stack frame of a Triton kernel holds nothing but spills."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run(
            [_CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    finally:
        os.unlink(f.name)
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", out)
    if usage is None:
        raise RuntimeError(f"cuobjdump printed no resource usage: {out!r}")
    registers, stack, local = (int(g) for g in usage.groups())
    return registers, stack + local


@dataclass(frozen=True)
class Side:
    """One side of a configuration: a cache (paged), a mirror of blocks, or the wire."""

    kind: str  # "cache" | "mirror" | "wire"
    layout: str = "NHD"
    placement: str = "kv_first"
    mla: bool = False
    block_size: int = 16
    heads: int = 8
    head_offset: int = 0


def _buffer(side: Side, moved: int, head_dim: int, dtype: torch.dtype, tokens: int) -> KVBuffer:
    layers = 2
    if side.kind == "wire":
        shape = (layers, tokens, head_dim) if side.mla else (layers, 2, tokens, moved, head_dim)
        return wire_kv_buffer(torch.zeros(shape, dtype=dtype), 0, side.mla)
    blocks = -(-tokens // side.block_size)
    heads = 1 if side.mla else (moved if side.kind == "mirror" else side.heads)
    shape = layer_shape(
        blocks, side.block_size, heads, head_dim, side.layout, side.placement, side.mla
    )
    numel = 1
    for n in shape:
        numel *= n
    if side.kind == "mirror":
        flat = torch.zeros(layers * numel, dtype=dtype)
        return KVBuffer(
            StackedLayers(flat, layers, shape), side.layout, side.placement, side.mla, None, 0, 0
        )
    caches = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
    ids = torch.arange(blocks, dtype=torch.int64)
    return KVBuffer(caches, side.layout, side.placement, side.mla, ids, 0, side.head_offset)


@dataclass(frozen=True)
class Config:
    """One kernel configuration the planner can produce."""

    name: str
    src: Side
    dst: Side
    moved: int = 8
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16
    dst_dtype: torch.dtype | None = None  # a converting copy: the destination's dtype

    def launch(self) -> CellCopyLaunch:
        """Prepare the launch on small CPU tensors of this geometry."""
        tokens = 192  # a multiple of every block size below
        dst_dtype = self.dst_dtype or self.dtype
        src = _buffer(self.src, self.moved, self.head_dim, self.dtype, tokens)
        dst = _buffer(self.dst, self.moved, self.head_dim, dst_dtype, tokens)
        scales = None
        if scale_mode(self.dtype, dst_dtype):
            scales = torch.ones((2, 1 if self.src.mla else 2), dtype=torch.float32)
        return prepare_cell_copy(src, dst, 0, tokens, self.moved, scales=scales)


CACHE_NHD = Side("cache", "NHD")
CACHE_HND = Side("cache", "HND")
WIRE = Side("wire")
HND_64 = Side("cache", "HND", block_size=64)
MLA_WIRE = Side("wire", mla=True)
FP8_E4M3, FP8_E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CONFIGS = [
    Config("pack NHD bs16 -> wire", CACHE_NHD, WIRE),
    Config("pack HND bs16 -> wire", CACHE_HND, WIRE),
    Config("unpack wire -> NHD bs16", WIRE, CACHE_NHD),
    Config("unpack wire -> HND bs64", WIRE, HND_64),
    Config("pack NHD heads 2:4 of 8 -> wire", Side("cache", head_offset=2), WIRE, moved=2),
    Config("pack HND head 5 of 8 -> wire", Side("cache", "HND", head_offset=5), WIRE, moved=1),
    Config("pack NHD blocks_first bs16 -> wire", Side("cache", placement="blocks_first"), WIRE),
    Config("pack kv_inner NHD bs16 -> wire", Side("cache", placement="kv_inner"), WIRE),
    Config(
        "unpack wire -> kv_inner HND bs32", WIRE, Side("cache", "HND", "kv_inner", block_size=32)
    ),
    Config("remap NHD bs16 -> HND bs48", CACHE_NHD, Side("cache", "HND", block_size=48)),
    Config(
        "remap HND blocks_first bs64 -> NHD",
        Side("cache", "HND", "blocks_first", block_size=64),
        CACHE_NHD,
    ),
    Config("pack NHD bs16 -> mirror HND bs64", CACHE_NHD, Side("mirror", "HND", block_size=64)),
    Config("land mirror HND bs64 -> HND bs64", Side("mirror", "HND", block_size=64), HND_64),
    Config("pack NHD head_dim 64", CACHE_NHD, WIRE, head_dim=64),
    Config("pack HND head_dim 256", CACHE_HND, WIRE, head_dim=256),
    Config("pack fp8 e4m3 NHD bs16 -> wire", CACHE_NHD, WIRE, dtype=FP8_E4M3),
    Config("unpack wire -> fp8 e5m2 HND bs16", WIRE, CACHE_HND, dtype=FP8_E5M2),
    Config("pack MLA 576 bs64 -> wire", Side("cache", mla=True, block_size=64), MLA_WIRE, 1, 576),
    Config("unpack wire -> MLA 576 bs16", MLA_WIRE, Side("cache", mla=True), 1, 576),
    Config("narrow: fp16 head_dim 5 (10-byte rows)", CACHE_NHD, WIRE, 8, 5, torch.float16),
    # Converting copies (docs/kernels-and-layouts.md, "Dtype conversion"): quantizing packs,
    # dequantizing unpacks, an MLA latent, a widening and a narrowing between 16/32 bits.
    Config("pack bfloat16->float8_e4m3fn NHD bs16 -> wire", CACHE_NHD, WIRE, dst_dtype=FP8_E4M3),
    Config(
        "pack bfloat16->float8_e5m2 HND bs16 -> mirror HND bs64",
        CACHE_HND,
        Side("mirror", "HND", block_size=64),
        dst_dtype=FP8_E5M2,
    ),
    Config(
        "unpack float8_e4m3fn->bfloat16 wire -> HND bs64",
        WIRE,
        HND_64,
        dtype=FP8_E4M3,
        dst_dtype=torch.bfloat16,
    ),
    Config(
        "unpack float8_e5m2->float16 wire -> kv_inner HND bs32",
        WIRE,
        Side("cache", "HND", "kv_inner", block_size=32),
        dtype=FP8_E5M2,
        dst_dtype=torch.float16,
    ),
    Config(
        "pack MLA 576 bfloat16->float8_e4m3fn bs64 -> wire",
        Side("cache", mla=True, block_size=64),
        MLA_WIRE,
        1,
        576,
        dst_dtype=FP8_E4M3,
    ),
    Config(
        "unpack float32->bfloat16 wire -> NHD bs16",
        WIRE,
        CACHE_NHD,
        dtype=torch.float32,
        dst_dtype=torch.bfloat16,
    ),
    Config(
        "unpack float8_e4m3fn->float32 wire -> NHD bs16",
        WIRE,
        CACHE_NHD,
        dtype=FP8_E4M3,
        dst_dtype=torch.float32,
    ),
]


def codegen_row(config: Config) -> dict[str, Any]:
    """Compile one configuration and read what the compiler made of it."""
    launch = config.launch()
    compiled = compile_launch(launch)
    ptx = compiled.asm["ptx"]
    ld_bits, st_bits = data_access_bits(ptx)
    registers, spills = resource_usage(compiled.asm["cubin"])
    return {
        "config": config.name,
        "aligned": bool(launch.arguments["ALIGNED"]),
        "block_t": launch.arguments["BLOCK_T"],
        "num_warps": launch.num_warps,
        "ld_bits": ld_bits,
        "st_bits": st_bits,
        "registers": registers,
        "spill_bytes": spills,
        "div64": bool(_DIV64.search(ptx)),
    }


def problems(row: dict[str, Any]) -> list[str]:
    """What an aligned row gets wrong: narrower accesses, spills or 64-bit division."""
    if not row["aligned"]:
        return []
    found = []
    if row["ld_bits"] != 128 or row["st_bits"] != 128:
        found.append(f"accesses of {row['ld_bits']}/{row['st_bits']} bits, not 128")
    if row["spill_bytes"]:
        found.append(f"{row['spill_bytes']} bytes of spills")
    if row["div64"]:
        found.append("64-bit division")
    return found


def figure(report: dict[str, Any]) -> tuple[str, str]:
    """The page's figure and targets: the aligned rows' accesses, registers and spills."""
    aligned = [r for r in report["rows"] if r["aligned"]]
    clean = [r for r in aligned if not problems(r)]
    registers = sorted(r["registers"] for r in aligned)
    text = (
        f"{len(clean)} of {len(aligned)} aligned configurations: 16-byte loads and stores, no "
        f"spills, no 64-bit division; {registers[0]}-{registers[-1]} registers"
    )
    return text, f"no spills ({'met' if len(clean) == len(aligned) else 'not met'})"


def main(argv: list[str] | None = None) -> int:
    """Print the codegen table (or JSON); with --check, fail on any problem."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--check", action="store_true", help="exit 1 on any problem")
    BENCHMARK.add_record_flag(parser)
    args = parser.parse_args(argv)
    rows = []
    for config in CONFIGS:
        rows.append(codegen_row(config))
        print(f"compiled {config.name}", file=sys.stderr)
    if args.json:
        print(json.dumps({"target": "sm_90", "rows": rows}, indent=1))
    else:
        print(f"{'config':56} aligned  T warps  ld  st  regs spill div64")
        for r in rows:
            print(
                f"{r['config']:56} {r['aligned']!s:7} {r['block_t']:2} {r['num_warps']:5} "
                f"{r['ld_bits']:3} {r['st_bits']:3} {r['registers']:5} {r['spill_bytes']:5} "
                f"{r['div64']!s}"
            )
    BENCHMARK.record(args.record, argv, {"target": "sm_90", "rows": rows}, figure)
    bad = [(r["config"], p) for r in rows for p in problems(r)]
    for name, problem in bad:
        print(f"FAIL {name}: {problem}", file=sys.stderr)
    return 1 if args.check and bad else 0


if __name__ == "__main__":
    sys.exit(main())
