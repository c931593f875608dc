"""A decode worker's loads: each request vLLM ordered loaded, from its order until vLLM hears
that it ended, and the blocks of the loads that failed.

A load waits for its prefill engine's connect (`remotes`), then runs as a fetch whose
`GroupedFetch` handle is kept: no thread per load, so loads that wait for a request never
published cost nothing to the others. It ends with the fetch's result, or with a result of its
own when it ends without a fetch (its engine's connect failed or did not come in time, the
fetch was refused, vLLM aborted it while it waited). `fetch_timeout_s` bounds it from vLLM's
order, connect included.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvxfer.connector import GroupedFetch, TransferResult
from kvxfer.integrations.vllm.metadata import AbortSpec, LoadSpec, Route


@dataclass
class Load:
    """A load on this decode worker: waiting for its prefill engine's connect, then a fetch.

    Attributes:
        spec: vLLM's order.
        route: how its engine's ranks are found.
        deadline: `fetch_timeout_s` after vLLM ordered it (monotonic), connect included.
        handle: its fetch, once started.
        result: set when it ended without a fetch.
        aborted: vLLM finished the request: nothing to report but the end.
    """

    spec: LoadSpec
    route: Route
    deadline: float
    handle: GroupedFetch | None = None
    result: TransferResult | None = None
    aborted: bool = False

    @property
    def waiting(self) -> bool:
        """Whether it still waits for its engine's connect (no fetch, no result)."""
        return self.handle is None and self.result is None

    def abort(self) -> bool:
        """Give it up (vLLM finished the request): its fetch, if one runs, is cancelled (it
        ends soon, nothing of it lands afterwards). Returns whether it was still waiting for a
        connect: it then ends here, and its engine must stop holding it."""
        self.aborted = True
        if self.handle is not None:
            self.handle.cancel()
            return False
        if self.result is None:  # nothing can land
            self.result = TransferResult(False, [], 0, 0, "", 0.0, ["aborted"])
            return True
        return False

    def finished(self) -> TransferResult | None:
        """Its result once it ended (None: still waiting or fetching)."""
        if self.result is None and self.handle is not None and self.handle.done():
            return self.handle.wait()
        return self.result


class Loads:
    """The loads in flight on this worker, by vLLM's request id, and the blocks of those that
    failed, until vLLM asks for them (`take_errors`)."""

    def __init__(self) -> None:
        self._loading: dict[str, Load] = {}
        self._errors: set[int] = set()

    def start(self, spec: LoadSpec, deadline: float) -> Load:
        """A new load of `spec`, to end by `deadline`."""
        load = Load(spec, Route.of(spec.remote), deadline)
        self._loading[spec.request_id] = load
        return load

    def of_abort(self, abort: AbortSpec) -> Load | None:
        """The load `abort` gives up, if one runs here (of that remote request)."""
        load = self._loading.get(abort.request_id)
        if load is not None and load.spec.remote_request_id == abort.remote_request_id:
            return load
        return None

    def overdue(self, now: float) -> list[Load]:
        """The loads still waiting for a connect at their deadline."""
        return [load for load in self._loading.values() if load.waiting and now >= load.deadline]

    def take_finished(self) -> list[tuple[Load, TransferResult]]:
        """Remove and return the loads that ended, with their results."""
        ended = []
        for request_id, load in list(self._loading.items()):
            result = load.finished()
            if result is not None:
                del self._loading[request_id]
                ended.append((load, result))
        return ended

    def add_errors(self, block_ids: list[int]) -> None:
        """Blocks a load failed to fill, for vLLM to recompute."""
        self._errors.update(block_ids)

    def take_errors(self) -> set[int]:
        """The failed blocks since the last call."""
        errors, self._errors = self._errors, set()
        return errors
