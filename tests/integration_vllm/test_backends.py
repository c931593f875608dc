"""The attention-backend table: every engine layout comes from it, checked against the
strides; a backend, cache dtype or CPU instruction set it does not list is refused at start.

The probe of the table against a backend's own cache write is tests/e2e/ (vLLM's CPU build
runs CPU attention's op); the GPU backends' probes are in benchmarks/gpu_kernels.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvxfer.integrations.kv_tensors import EngineGeometry
from kvxfer.integrations.vllm.backends import (
    BACKEND_LAYOUTS,
    VERIFIED_VLLM_VERSIONS,
    backend_reading,
    engine_reading,
)
from kvxfer.integrations.vllm.cache_groups import cache_groups

GEOMETRY = EngineGeometry(total_kv_heads=4, head_dim=8, block_size=16, tp_size=1, tp_rank=0)


def _lbhnc(num_blocks: int = 6) -> torch.Tensor:
    """A layer as vLLM registers it in the LBHNC layout: `[blocks, heads, block_size, 2d]`."""
    return torch.zeros(num_blocks, 4, 16, 16, dtype=torch.bfloat16)


def test_every_backend_of_the_table_is_one_of_this_vllm_versions_backends() -> None:
    """The table names backends as the installed vLLM names them (its registry)."""
    import vllm
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert ".".join(vllm.__version__.split(".")[:2]) in VERIFIED_VLLM_VERSIONS
    assert set(BACKEND_LAYOUTS) <= set(AttentionBackendEnum.__members__)


def test_cpu_attention_reads_as_k_transposed_and_gpu_rows_from_the_strides() -> None:
    caches = {"model.layers.0.self_attn.attn": _lbhnc(), "model.layers.1.self_attn.attn": _lbhnc()}
    for backend, isa, placement in (
        ("CPU_ATTN", "vec", "k_transposed"),
        ("CPU_ATTN", "vec16", "k_transposed"),
        ("FLASH_ATTN", None, "kv_inner"),
        ("TRITON_ATTN", None, "kv_inner"),
    ):
        backends = {name: (backend, isa) for name in caches}
        (group,), _ = cache_groups(caches, None, GEOMETRY, backends)
        assert (group.spec.layout, group.spec.kv_placement) == ("HND", placement), backend
    # AMX's tile groups: blocks and head_dim multiples of 16 (vLLM's amx ISA: blocks of 32s)
    amx = {"model.layers.0.self_attn.attn": torch.zeros(6, 4, 32, 32, dtype=torch.bfloat16)}
    geometry = dataclasses.replace(GEOMETRY, head_dim=16, block_size=32)
    backends = {name: ("CPU_ATTN", "amx") for name in amx}
    (group,), _ = cache_groups(amx, None, geometry, backends)
    assert (group.spec.layout, group.spec.kv_placement) == ("HND", "amx_tiles")


@pytest.mark.parametrize(
    ("backend", "isa", "rounding"),
    [("CPU_ATTN", "vec", "toward_zero"), ("FLASH_ATTN", None, "nearest_even")],
)
def test_an_fp8_cache_keeps_how_its_backend_writes_it(backend, isa, rounding) -> None:
    """vLLM's fp8 caches are uint8 tensors: CPU attention's spec says its write truncates
    (`KVCacheSpec.fp8_rounding`), so that a converting transfer writes its bytes."""
    caches = {"model.layers.0.self_attn.attn": torch.zeros(6, 4, 16, 16, dtype=torch.uint8)}
    geometry = dataclasses.replace(GEOMETRY, kv_cache_dtype="fp8_e4m3")
    backends = {name: (backend, isa) for name in caches}
    (group,), _ = cache_groups(caches, None, geometry, backends)
    assert (group.spec.dtype, group.spec.fp8_rounding) == ("float8_e4m3fn", rounding)


@pytest.mark.parametrize(
    ("backend", "dtype", "isa", "problem"),
    [
        pytest.param("SOME_NEW_ATTN", "auto", None, "not in kvxfer's table", id="unknown"),
        pytest.param("CPU_ATTN", "auto", "amx_fp8", "instruction set 'amx_fp8'", id="cpu-amx-fp8"),
        pytest.param("CPU_ATTN", "auto", "neon", "instruction set 'neon'", id="cpu-neon"),
        pytest.param(
            "TRITON_ATTN", "fp8_per_token_head", None, "fp8_per_token_head", id="per-token-fp8"
        ),
        pytest.param("FLASHINFER", "nvfp4", None, "nvfp4", id="nvfp4"),
        pytest.param("FLASHMLA", "fp8_ds_mla", None, "fp8_ds_mla", id="ds-mla"),
    ],
)
def test_a_layout_kvxfer_has_not_verified_is_refused(backend, dtype, isa, problem) -> None:
    with pytest.raises(ValueError, match=problem):
        backend_reading(backend, dtype, isa)


def test_the_worker_refuses_what_the_table_refuses_naming_the_layer() -> None:
    caches = {"model.layers.0.self_attn.attn": _lbhnc()}
    with pytest.raises(ValueError, match=r"SOME_NEW_ATTN.*layer model\.layers\.0"):
        cache_groups(caches, None, GEOMETRY, {n: ("SOME_NEW_ATTN", None) for n in caches})
    with pytest.raises(ValueError, match="cannot tell the attention backend"):
        cache_groups(caches, None, GEOMETRY, {})  # never guessed from the strides
    with pytest.raises(ValueError, match="latent cache, but the model does not use MLA"):
        cache_groups(caches, None, GEOMETRY, {n: ("FLASHMLA", None) for n in caches})


def test_strides_that_contradict_the_table_are_refused() -> None:
    """CPU attention registers LBHNC views; an NHD (LBNHC) tensor under CPU_ATTN is a layout
    the table does not describe."""
    lbnhc = torch.zeros(6, 16, 4, 16, dtype=torch.bfloat16).transpose(1, 2)
    caches = {"model.layers.0.self_attn.attn": lbnhc}
    with pytest.raises(ValueError, match="read as NHD/kv_inner"):
        cache_groups(caches, None, GEOMETRY, {n: ("CPU_ATTN", "vec") for n in caches})


def test_layers_that_disagree_are_refused() -> None:
    layers = [("a", "CPU_ATTN", "vec"), ("b", "FLASH_ATTN", None)]
    with pytest.raises(ValueError, match="different KV layouts"):
        engine_reading(layers, "auto")


def test_a_cpu_worker_pinned_to_one_core_is_refused_with_the_fix() -> None:
    """vLLM's CPU build binds the connector's thread to one core ("auto" binding): kvxfer's
    threads would inherit it and starve, so the worker refuses to start."""
    from kvxfer.integrations.vllm.worker import check_threads_can_run

    with pytest.raises(ValueError, match="VLLM_CPU_OMP_THREADS_BIND=nobind"):
        check_threads_can_run("cpu", {0})
    check_threads_can_run("cpu", {0, 1})  # nobind: the process's cores
    check_threads_can_run("cuda", {0})  # GPU workers: vLLM does not pin them this way
