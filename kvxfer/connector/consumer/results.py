"""What a caller of `KVConsumer.fetch` holds: the `FetchHandle` of a fetch in progress, and its
`TransferResult` once it has finished."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TransferResult:
    """The outcome of one fetch on one decode rank.

    Attributes:
        ok: every byte of tokens `[start_token, num_tokens)` is in place.
        failed_block_ids: destination blocks not (fully) written; recompute them. Nothing of
            this fetch lands in them any more: they are safe to reuse at once.
        bytes: bytes read into this rank.
        num_ops: transport operations (segments) used.
        strategy: the strategies used, comma-separated when pairs differ.
        seconds: wall time of the fetch.
        errors: what went wrong, for logs.
        timeline: the request's events as far as this rank saw them
            (`kvxfer.connector.timeline`): the producers' (the prefill's, sent with the
            chunks) and this fetch's own (`fetch_asked`, `first_chunk_offered`,
            `first_byte_read`, `last_byte_read`, `fetch_done`), in wall-clock seconds.
    """

    ok: bool
    failed_block_ids: list[int]
    bytes: int
    num_ops: int
    strategy: str
    seconds: float
    errors: list[str] = field(default_factory=list)
    timeline: dict[str, float] = field(default_factory=dict)


class FetchHandle:
    """A fetch in progress."""

    def __init__(self, request_id: str, wake: Callable[[], None]) -> None:
        self.request_id = request_id
        self.future: Future[TransferResult] = Future()
        self.cancelled = threading.Event()
        self.chunks_done = 0
        self.chunks_total = 0
        self._wake = wake

    def done(self) -> bool:
        """Whether the fetch has finished."""
        return self.future.done()

    def wait(self, timeout: float | None = None) -> TransferResult:
        """The result; if `timeout` passes first, the fetch is abandoned and reports every
        block it had not completed as failed (nothing of it lands afterwards)."""
        try:
            return self.future.result(timeout)
        except FutureTimeout:
            self.cancel()
            return self.future.result()

    def cancel(self) -> None:
        """Abandon the fetch: it completes soon, with its unfinished blocks failed."""
        self.cancelled.set()
        self._wake()
