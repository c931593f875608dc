"""Where each vLLM attention backend keeps K and V: the table kvxfer reads engine layouts from.

A cache tensor's strides do not always show its physical layout: vLLM's CPU attention
registers `[blocks, heads, block_size, 2 * head_dim]` views with the strides of the GPU
layout LBHNC, and keeps K transposed inside each (block, head). So the layout of every
backend kvxfer supports is a row of `BACKEND_LAYOUTS`, read from vLLM's source for each
supported version (docs/engine-layouts.md gives the lines), and a backend, cache dtype or CPU
instruction set that is not in the table is refused at start, with what to do: never guessed.

Readings:
- `rows`: each `[.., 2 * head_dim]` row holds a token's K then V (or the 5-D K/V planes of
  older layouts): the strides show the rest, `kvxfer.integrations.kv_tensors` reads them;
- `k_transposed`: vLLM CPU attention (`kv_placement` "k_transposed", `kvxfer.layout`);
- `amx_tiles`: vLLM CPU attention with the `amx` ISA (`kv_placement` "amx_tiles");
- `latent`: an MLA latent cache, `[blocks, block_size, latent]`.

This module imports nothing from vLLM: `engine_reading` takes the backend names and CPU
instruction sets the worker read from vLLM's attention layers (`geometry.attention_backends`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from kvxfer.spec import FP8Rounding

Reading = Literal["rows", "k_transposed", "amx_tiles", "latent"]

# The vLLM minor versions whose source the table was read from.
VERIFIED_VLLM_VERSIONS: tuple[str, ...] = ("0.32", "0.33")
# kv_cache_dtype settings whose caches hold plain values (fp8 ones as bytes of one format).
_PLAIN_DTYPES = ("auto", "float16", "bfloat16", "float32", "half", "float")
_FP8_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class BackendLayout:
    """One attention backend's physical KV layout, as read from vLLM's source.

    Attributes:
        name: the backend's `AttentionBackend.get_name()`.
        reading: how kvxfer reads its cache tensors (the module docstring).
        cache_dtypes: the `kv_cache_dtype` settings whose layout was read; others (per-token
            scales inside the rows, NVFP4's separate head groups, DeepSeek's fp8_ds_mla with
            scales in the cache) are refused.
        isas: CPU attention's instruction sets whose cache write was read and probed (None:
            not a CPU backend).
        source: where in vLLM the layout was read.
        fp8_rounding: how its cache write rounds into an fp8 cache (`KVCacheSpec.fp8_rounding`).
        isa_readings: CPU instruction sets whose cache write keeps another reading than
            `reading`.
    """

    name: str
    reading: Reading
    cache_dtypes: tuple[str, ...]
    source: str
    isas: tuple[str, ...] | None = None
    fp8_rounding: FP8Rounding = "nearest_even"
    isa_readings: tuple[tuple[str, Reading], ...] = ()


_GPU_ROWS = "kv_cache.transpose(1, 2).split(head_size, dim=-1): K then V in each row"
BACKEND_LAYOUTS: dict[str, BackendLayout] = {
    layout.name: layout
    for layout in (
        BackendLayout(
            "FLASH_ATTN",
            "rows",
            (*_PLAIN_DTYPES, *_FP8_DTYPES),
            f"v1/attention/backends/flash_attn.py: {_GPU_ROWS}",
        ),
        BackendLayout(
            "FLEX_ATTENTION",
            "rows",
            _PLAIN_DTYPES,
            f"v1/attention/backends/flex_attention.py: {_GPU_ROWS}",
        ),
        BackendLayout(
            "TRITON_ATTN",
            "rows",
            (*_PLAIN_DTYPES, *_FP8_DTYPES),
            f"v1/attention/backends/triton_attn.py: {_GPU_ROWS}; the *_per_token_head "
            "dtypes keep each head's scales inside its row (padded_hs), refused",
        ),
        BackendLayout(
            "FLASHINFER",
            "rows",
            (*_PLAIN_DTYPES, *_FP8_DTYPES),
            "v1/attention/backends/flashinfer.py: kv_cache_permute.split(head_size, dim=-1); "
            "NVFP4 keeps K and V as separate head groups (split(num_kv_heads, dim=1)), refused",
        ),
        *(
            BackendLayout(
                name,
                "latent",
                (*_PLAIN_DTYPES, *_FP8_DTYPES),
                f"v1/attention/backends/mla/{module}.py: one latent row per token; "
                "fp8_ds_mla keeps scales inside the cache, refused",
            )
            for name, module in (
                ("FLASHMLA", "flashmla"),
                ("FLASH_ATTN_MLA", "flashattn_mla"),
                ("TRITON_MLA", "triton_mla"),
                ("CUTLASS_MLA", "cutlass_mla"),
                ("FLASHINFER_MLA", "flashinfer_mla"),
            )
        ),
        BackendLayout(
            "CPU_MLA",
            "latent",
            _PLAIN_DTYPES,
            "v1/attention/backends/mla/cpu_mla.py: CPUMLAImpl.do_kv_cache_update writes "
            "kv_cache.view(-1, kv_lora_rank + rope_dim)[slot] = (latent, rope key): one row "
            "per token; only the 576-wide latent, blocks of 16, kv_cache_dtype auto",
        ),
        BackendLayout(
            "CPU_ATTN",
            "k_transposed",
            (*_PLAIN_DTYPES, *_FP8_DTYPES),
            "v1/attention/backends/cpu_attn.py: kv_cache.view(blocks, heads, 2 * block_size, "
            "head_dim).chunk(2, dim=2), written by cpu_attn_reshape_and_cache: K as "
            "[head_dim, block_size], V as [block_size, head_dim]; fp8 caches (AVX-512, ISA "
            "vec) the same layout in bytes, quantized by csrc/cpu/cpu_attn_fp8.hpp's "
            "float_to_fp8e4m3_scalar / float_to_fp8e5m2_scalar (truncating); ISA amx (bf16 "
            "and fp8 caches, blocks of 32s): csrc/cpu/cpu_attn_amx.hpp and cpu_attn_fp8.hpp's "
            "reshape_and_cache_fp8_amx_impl, K pairs of dims in groups of 16 slots, V pairs "
            "of slots in groups of 16 dims (amx_tiles)",
            isas=("vec", "vec16", "amx"),
            fp8_rounding="toward_zero",
            isa_readings=(("amx", "amx_tiles"),),
        ),
    )
}


def backend_reading(name: str, kv_cache_dtype: str, isa: str | None = None) -> Reading:
    """How kvxfer reads the caches of attention backend `name` (vLLM's `get_name()`), with
    the engine's `kv_cache_dtype` and, for CPU attention, the layers' instruction set.

    Raises:
        ValueError: a backend, cache dtype or instruction set kvxfer has not verified, naming
            it and what to do.
    """
    layout = BACKEND_LAYOUTS.get(name)
    if layout is None:
        raise ValueError(
            f"kvxfer: attention backend {name!r} is not in kvxfer's table of verified KV "
            f"layouts ({', '.join(sorted(BACKEND_LAYOUTS))}; vLLM "
            f"{', '.join(VERIFIED_VLLM_VERSIONS)}): its physical layout cannot be read from "
            "the tensors' strides alone; choose a supported backend (vLLM's "
            "--attention-backend) or add the backend to kvxfer/integrations/vllm/backends.py "
            "from vLLM's source, with its probe"
        )
    if kv_cache_dtype not in layout.cache_dtypes:
        raise ValueError(
            f"kvxfer: attention backend {name} with kv_cache_dtype {kv_cache_dtype!r} keeps a "
            f"layout kvxfer has not verified; use one of {list(layout.cache_dtypes)}"
        )
    if layout.isas is not None and isa not in layout.isas:
        raise ValueError(
            f"kvxfer: {name} with CPU instruction set {isa!r} writes its cache in a layout "
            f"kvxfer has not verified (verified: {list(layout.isas)}); run the engine where "
            "vLLM picks one of those"
        )
    return dict(layout.isa_readings).get(isa or "", layout.reading)


def engine_reading(layers: Iterable[tuple[str, str, str | None]], kv_cache_dtype: str) -> Reading:
    """The one reading of a KV cache group's attention layers, each given as (layer name,
    backend name, CPU instruction set or None).

    Raises:
        ValueError: no layers, a layer whose backend `backend_reading` refuses, or layers
            that disagree.
    """
    readings: dict[Reading, str] = {}
    for layer, backend, isa in layers:
        try:
            readings.setdefault(backend_reading(backend, kv_cache_dtype, isa), layer)
        except ValueError as exc:
            raise ValueError(f"{exc} (layer {layer})") from None
    if not readings:
        raise ValueError("kvxfer: no attention layer to read a KV layout from")
    if len(readings) > 1:
        raise ValueError(
            f"kvxfer: the attention layers keep different KV layouts ({readings}); kvxfer needs "
            "one layout per KV cache group"
        )
    (reading,) = readings
    return reading


def engine_fp8_rounding(backend: str) -> FP8Rounding:
    """How attention backend `backend`'s cache write rounds into an fp8 cache (a backend
    `backend_reading` accepted)."""
    return BACKEND_LAYOUTS[backend].fp8_rounding
