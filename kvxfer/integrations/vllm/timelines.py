"""A decode engine's per-request timelines (`kvxfer.connector.timeline`), kept by its
scheduler: each load's events from its workers (and, through them, the prefill's), the
request's arrival, when vLLM scheduled it with its KV and when its first token was there.

When a request's first token is there its phases go into the scheduler's statistics (vLLM's
Prometheus endpoint: `vllm:kvxfer_request_phase_seconds`) and one debug line into the log
(`kvxfer.integrations.vllm.timelines`, shown at `KVXFER_LOGGING_LEVEL=DEBUG`:
`kvxfer.integrations.vllm.logs`).

- `decode_scheduled`: the first scheduler step, after every worker reported the load finished,
  that schedules the request;
- `first_token`: the first scheduler step (or its finish) that finds an output token on it.
  vLLM schedules a step after the last one's output is in, so this is when the token was there,
  give or take one step's scheduling (with asynchronous scheduling, one step later).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvxfer.connector.timeline import describe, mark, merge, phases

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class RequestTimelines:
    """The timelines of the requests a decode scheduler loads, from their load's start to
    their first token (or their finish)."""

    def __init__(self) -> None:
        self._requests: dict[str, Request] = {}
        self._timelines: dict[str, dict[str, float]] = {}
        self._loaded: set[str] = set()  # every worker reported the load finished
        self._finished: list[dict[str, float]] = []  # phases not taken yet

    def load_started(self, request: Request) -> None:
        """The request's load was ordered (vLLM allocated its blocks)."""
        request_id = request.request_id
        self._requests[request_id] = request
        arrived = float(request.arrival_time)
        self._timelines[request_id] = {"arrived": arrived, "decode_arrived": arrived}
        mark(self._timelines[request_id], "load_ordered")

    def connector_output(self, output: KVConnectorOutput) -> None:
        """The workers' reports of one step: their loads' timelines, the loads finished."""
        data = getattr(output.kv_connector_stats, "data", None) or {}
        for request_id, events in data.get("timelines", ()):
            timeline = self._timelines.get(request_id)
            if timeline is not None:
                merge(timeline, events)
        for request_id in output.finished_recving or ():
            if request_id in self._timelines:
                self._loaded.add(request_id)

    def step_scheduled(self, output: SchedulerOutput) -> None:
        """A scheduler step: loaded requests it schedules for the first time, and first tokens
        that came since the last step."""
        if not self._timelines:
            return
        for request_id in _scheduled_ids(output):
            timeline = self._timelines.get(request_id)
            if request_id in self._loaded and timeline and "decode_scheduled" not in timeline:
                mark(timeline, "decode_scheduled")
        for request_id in [r for r in self._loaded if _has_output(self._requests[r])]:
            if "decode_scheduled" in self._timelines[request_id]:
                self._close(request_id)

    def request_finished(self, request_id: str) -> None:
        """vLLM finished the request: its timeline ends (with its first token, if it has one;
        a request finished before one came, aborted or failed, counts no phases)."""
        if request_id not in self._timelines:
            return
        request = self._requests[request_id]
        if _has_output(request) and "decode_scheduled" in self._timelines[request_id]:
            self._close(request_id)
        else:
            self._forget(request_id)

    def take_phases(self) -> list[dict[str, float]]:
        """The phases of the requests whose timeline ended since the last call."""
        finished, self._finished = self._finished, []
        return finished

    def _close(self, request_id: str) -> None:
        timeline = self._timelines[request_id]
        mark(timeline, "first_token")
        self._finished.append(phases(timeline))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("kvxfer timeline: %s", describe(request_id, timeline))
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self._timelines.pop(request_id, None)
        self._requests.pop(request_id, None)
        self._loaded.discard(request_id)


def _scheduled_ids(output: SchedulerOutput) -> list[str]:
    """The requests a scheduler step runs."""
    ids: list[str] = [new.req_id for new in output.scheduled_new_reqs]
    cached: Any = output.scheduled_cached_reqs
    ids.extend(cached.req_ids)
    return ids


def _has_output(request: Request) -> bool:
    return request.num_output_tokens > 0
