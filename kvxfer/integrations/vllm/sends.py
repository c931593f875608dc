"""A prefill worker's sends: the requests it published, until vLLM hears they are finished
sending (every decode worker fetched them, or the producer gave up on them at its
`request_timeout_s`), so that vLLM frees their blocks."""

from __future__ import annotations

import queue

from kvxfer.connector import ReleaseReason


class Sends:
    """The published requests whose release vLLM has not been told of yet.

    vLLM accepts a finished send only for a request it has told this worker is finished (it
    always has, in the step that publishes; kept as a guard). Only published ids are
    remembered, so the sets stay as small as the requests in flight. A request may be offered
    under another id than vLLM's (a router's `transfer_id`): the producer releases that id,
    vLLM hears of its own.
    """

    def __init__(self) -> None:
        # from the producer's thread: (offered id, why)
        self._released: queue.SimpleQueue[tuple[str, ReleaseReason]] = queue.SimpleQueue()
        self._unreported: set[str] = set()  # released, not reported yet
        self._published: set[str] = set()
        self._finished_seen: set[str] = set()  # published requests vLLM said are finished
        self._by_offered: dict[str, str] = {}  # offered id -> vLLM's, where they differ
        self._expired = 0  # released at their deadline, not taken by `take_expired` yet

    def published(self, request_id: str, offered_as: str | None = None) -> None:
        """The producer now offers vLLM's `request_id` (under `offered_as`, if given)."""
        self._published.add(request_id)
        if offered_as is not None and offered_as != request_id:
            self._by_offered[offered_as] = request_id

    def release(self, request_id: str, reason: ReleaseReason) -> None:
        """The producer released `request_id` (any thread: the producer's `release`)."""
        self._released.put((request_id, reason))

    def take_expired(self) -> int:
        """How many requests the producer released at their deadline since the last call
        (their release taken by `take_finished` already)."""
        expired, self._expired = self._expired, 0
        return expired

    def take_finished(self, finished_req_ids: set[str]) -> set[str]:
        """The requests to report finished sending now, given the requests vLLM says are
        finished (`get_finished`'s argument)."""
        self._finished_seen.update(finished_req_ids & self._published)
        while True:
            try:
                offered, reason = self._released.get_nowait()
            except queue.Empty:
                break
            self._expired += reason is ReleaseReason.EXPIRED
            self._unreported.add(self._by_offered.pop(offered, offered))
        sending = self._unreported & self._finished_seen
        self._unreported -= sending
        self._finished_seen -= sending
        self._published -= sending
        return sending
