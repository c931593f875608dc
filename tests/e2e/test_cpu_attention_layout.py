"""vLLM's CPU attention backends' own cache writes against kvxfer's reading of their layouts:
the probe of kvxfer's backend table (`kvxfer.integrations.vllm.backends`,
docs/engine-layouts.md): CPU attention, with its fp8 caches, and CPU MLA.

`cpu_attn_reshape_and_cache` is the op CPU attention's forward runs to store K and V. It writes
known K and V into a cache allocated as vLLM allocates it; kvxfer, told the backend and ISA as
the worker reads them from vLLM's layers, must read every element back from where the op put
it, and write another cache exactly as the op would have written it itself: between block
sizes, tensor-parallel slices and partial blocks, bit for bit, untouched slots poisoned
(`kvxfer/testing/backend_probe.py`, which the GPU script runs for the GPU backends).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from kvxfer import reshard
from kvxfer.testing import backend_probe as bp


@pytest.mark.parametrize("case", bp.default_cases("CPU_ATTN", "cpu"), ids=lambda c: c.name)
def test_kvxfer_reads_and_writes_where_cpu_attention_does(case: bp.Case) -> None:
    assert bp.probe(case)["placement"] == "k_transposed"


@pytest.mark.skipif(
    not bp.fp8_cache_writes(),
    reason="vLLM CPU attention writes fp8 caches on x86 with AVX-512 or AMX; this CPU has neither",
)
@pytest.mark.parametrize("case", bp.FP8_CASES, ids=lambda c: c.name)
def test_fp8_caches_hold_what_cpu_attention_writes(case: bp.Case) -> None:
    """A bf16 or float32 cache converted into an fp8 one holds, byte for byte, the op's own
    quantization of the same K and V (it truncates: `KVCacheSpec.fp8_rounding`); an fp8
    cache moved between block sizes keeps its bytes."""
    assert bp.probe(case)["dst_fp8_rounding"] == "toward_zero"


@pytest.mark.skipif(
    not bp.amx_cache_writes(), reason="vLLM's CPU op writes the AMX layout on x86 CPUs only"
)
@pytest.mark.parametrize("case", bp.AMX_CASES, ids=lambda c: c.name)
def test_the_amx_layout_holds_what_cpu_attention_writes(case: bp.Case) -> None:
    """ISA amx (bf16 and fp8 caches on CPUs with AMX tiles): kvxfer reads every element where
    the op put it, and writes an AMX cache, or CPU attention's `vec` one, as the op would."""
    placements = {"amx": "amx_tiles", "vec": "k_transposed"}
    assert bp.probe(case)["placement"] == placements[case.isa or ""]


@pytest.mark.parametrize("case", bp.default_cases("CPU_MLA", "cpu"), ids=lambda c: c.name)
def test_kvxfer_reads_and_writes_where_cpu_mla_does(case: bp.Case) -> None:
    """vLLM's CPU MLA backend (`CPUMLAImpl.do_kv_cache_update`, torch code): kvxfer reads
    each token's latent and rope key from the row the write put them in, and writes a cache
    of 64-token blocks (a GPU MLA backend's) exactly as that write does into one, and back."""
    assert bp.probe(case)["ok"]


def test_the_probe_catches_a_layout_read_from_the_strides_alone() -> None:
    """The probe can fail: told FLASH_ATTN (rows, what the strides suggest), kvxfer reads the
    CPU op's cache wrongly, and the probe says so."""
    case = bp.default_cases("CPU_ATTN", "cpu")[0]

    def cpu_op(case: bp.Case, *tensors: torch.Tensor) -> None:
        bp.WRITERS["CPU_ATTN"](replace(case, isa="vec"), *tensors)

    misread = {**bp.WRITERS, "FLASH_ATTN": cpu_op}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bp, "WRITERS", misread)
        with pytest.raises(bp.ProbeError, match="read K from elsewhere"):
            bp.probe(replace(case, backend="FLASH_ATTN", isa=None))


def test_tensor_parallel_slices_land_where_cpu_attention_keeps_them() -> None:
    """Prefill TP 1 -> decode TP 2, blocks 32 -> 64: each decode rank's cache equals what the
    op writes from that rank's heads."""
    case = bp.Case("CPU_ATTN", 32, 64, 32, "float32", 90, isa="vec")
    gen = torch.Generator().manual_seed(0)
    key, value = (torch.randn(case.tokens, case.heads, case.head_dim, generator=gen) for _ in "kv")
    src_ids = np.array([5, 1, 2])
    prefill = bp._allocate(case, 32, 8)
    bp.WRITERS["CPU_ATTN"](case, prefill, key, value, bp._slots(src_ids, 32, case.tokens, "cpu"))
    src = (*bp._kvxfer_view(case, prefill, 32), src_ids)
    half = replace(case, heads=case.heads // 2)  # each decode rank's heads
    decode = []
    for rank in range(2):
        cache = bp._allocate(half, 64, 4)
        decode.append((*bp._kvxfer_view(half, cache, 64, tp=2, rank=rank), np.array([3, 0])))
    reshard([src], decode, case.tokens)
    for rank, (_, (moved,), ids) in enumerate(decode):
        mine = slice(rank * half.heads, (rank + 1) * half.heads)
        written = bp._allocate(half, 64, 4)
        slots = bp._slots(ids, 64, case.tokens, "cpu")
        bp.WRITERS["CPU_ATTN"](
            half, written, key[:, mine].contiguous(), value[:, mine].contiguous(), slots
        )
        assert torch.equal(moved.view(torch.uint8), written.view(torch.uint8)), rank
