"""`CudaCopyStream` on a real CUDA device (skipped without one; `test_overlap.py` checks the
same calls on CPU with a stand-in for `torch.cuda`): a copy launched after `fence()` sees the
engine's work enqueued before the fence, and never waits for work enqueued after it."""

from __future__ import annotations

import pytest
import torch

from kvxfer.connector.streams import CudaCopyStream

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

POISON = -7
CYCLES_PER_MS = 2_000_000  # about 1 ms of `torch.cuda._sleep` at 2 GHz; an order of magnitude


def _engine_writes(value: int, numel: int = 1 << 22) -> torch.Tensor:
    """The engine's stream: a long kernel, then the KV the copy must see."""
    torch.cuda._sleep(50 * CYCLES_PER_MS)
    return torch.full((numel,), value, dtype=torch.int32, device="cuda")


def test_copy_after_fence_sees_the_engines_earlier_work():
    copies = CudaCopyStream(torch.device("cuda", 0))
    src = _engine_writes(0)
    dst = torch.full_like(src, POISON)
    torch.cuda.synchronize()
    torch.cuda._sleep(50 * CYCLES_PER_MS)
    src.fill_(42)  # enqueued behind the sleep: still pending when the copy is launched
    fence = copies.fence()
    copies.launch(lambda: dst.copy_(src), after=fence).wait()
    assert bool((dst == 42).all()), "the copy ran before the engine's write it was fenced after"


def test_copy_never_waits_for_work_enqueued_after_the_fence():
    copies = CudaCopyStream(torch.device("cuda", 0))
    src = _engine_writes(5)
    dst = torch.full_like(src, POISON)
    fence = copies.fence()
    torch.cuda._sleep(500 * CYCLES_PER_MS)  # the engine's next forward pass, after the hand-over
    later = torch.cuda.Event()
    later.record()
    done = copies.launch(lambda: dst.copy_(src), after=fence)
    done.wait()
    assert not later.query(), "the copy waited for engine work enqueued after its fence"
    assert bool((dst == 5).all())
    torch.cuda.synchronize()


def test_launch_from_a_worker_thread_uses_the_side_stream():
    from concurrent.futures import ThreadPoolExecutor

    copies = CudaCopyStream(torch.device("cuda", 0))
    src = _engine_writes(9)
    dst = torch.full_like(src, POISON)
    fence = copies.fence()
    seen: list[torch.cuda.Stream] = []

    def copy() -> None:
        seen.append(torch.cuda.current_stream())
        dst.copy_(src)

    with ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: copies.launch(copy, after=fence).wait()).result()
    assert seen == [copies.stream]
    assert bool((dst == 9).all())
