"""`RequestTable`: a producer's published requests, from `publish` to exactly one release.

A request is released when every rank of the decode engine that fetched it reported done, when
that engine aborts it before loading, at its deadline, or at `close`: whichever comes first, and
only once. Once an engine fetches a request, only that engine's reports count towards its
release, so a stranger's report cannot free blocks another engine reads. Released ids are
remembered for a while (so that a late fetch gets a clear answer and an id is not published
twice by mistake), then forgotten: the table's memory is bounded.
"""

from __future__ import annotations

import enum
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from kvxfer.connector.timeline import mark, merge

_generations = itertools.count(1)


class ReleaseReason(enum.Enum):
    """Why a producer released a published request: the `release` callback's second argument.

    An engine adapter frees the request's blocks whatever the reason; only `READ` says every
    decode rank that fetched the request is done with it. The value is the reason in words,
    for logs.
    """

    READ = "every decode rank is done"
    ABORTED = "its decode engine aborted it"
    EXPIRED = "its deadline passed"
    FAILED = "its prefill failed"
    CLOSED = "the producer closed"


@dataclass
class PublishedRequest:
    """A published request, until released."""

    block_ids: np.ndarray  # may cover fewer than `num_tokens` (a chunked prefill's, growing)
    num_tokens: int
    deadline: float
    generation: int  # tells this publication from an earlier one of the same id
    first_token: int = 0  # tokens before it are not held (a sliding window's dropped blocks)
    ready_tokens: int = 0  # tokens before it are computed in every layer
    # Tokens before `layer_tokens` are computed in this rank's layers before `ready_layers`
    # (the prefill step under way: `mark_ready` per layer, as each attention layer writes).
    layer_tokens: int = 0
    ready_layers: int = 0
    failure: str = ""  # the prefill failed it: every chunk not served yet fails with this
    covered: int = 0  # tokens the block table holds (`num_tokens` once it is whole)
    fetchers: dict[str, int] = field(default_factory=dict)  # engine id -> its ranks (PP x TP)
    reported: set[tuple[str, int]] = field(default_factory=set)  # (engine, rank) done
    # Its timeline so far (`kvxfer.connector.timeline`): the engine's events given at the
    # publish, and when its KV was first and last offered as computed.
    timeline: dict[str, float] = field(default_factory=dict)


class RequestTable:
    """Thread-safe; never calls out (the caller runs the release callback).

    Args:
        released_ttl_s: how long a released id is remembered.
        max_released: the most released ids remembered at once (oldest forgotten first).
    """

    def __init__(self, released_ttl_s: float = 600.0, max_released: int = 100_000) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, PublishedRequest] = {}
        self._released: OrderedDict[str, float] = OrderedDict()  # id -> when forgotten
        self._aborted: OrderedDict[str, float] = OrderedDict()  # unpublished id -> forget at
        # Decode ranks done with an id before it was published here (ranks that read nothing
        # from this producer may finish before it publishes): counted at its publish.
        self._early_done: OrderedDict[str, float] = OrderedDict()  # id -> forget at
        self._early_reports: dict[str, set[tuple[str, int, int]]] = {}  # (engine, rank, size)
        self._ttl, self._max_released = released_ttl_s, max_released

    def publish(
        self,
        request_id: str,
        block_ids: np.ndarray,
        num_tokens: int,
        timeout: float,
        first_token: int = 0,
        ready_tokens: int | None = None,
        covered: int | None = None,
        timeline: Mapping[str, float] | None = None,
    ) -> ReleaseReason | None:
        """Add a request that expires `timeout` seconds from now, holding tokens
        `[first_token, num_tokens)`, of which those before `ready_tokens` (default: all) are
        computed and those before `covered` (default: all) have their blocks in `block_ids`;
        `timeline`: the engine's events before the publish (its `prefill_scheduled`).

        Returns:
            Why to release the request at once, or None: a decode engine aborted it before it
            was published (`ABORTED`: nobody will fetch it), or every decode rank already
            reported done (`READ`: none of them reads from this producer).

        Raises:
            ValueError: the id is published, or was released recently.
        """
        with self._lock:
            now = time.monotonic()
            self._forget_old(now)
            if request_id in self._live or request_id in self._released:
                raise ValueError(
                    f"request_id: {request_id!r} was already published; use a new id per request"
                )
            request = self._live[request_id] = PublishedRequest(
                block_ids,
                num_tokens,
                now + timeout,
                next(_generations),
                first_token=first_token,
                ready_tokens=num_tokens if ready_tokens is None else ready_tokens,
                covered=num_tokens if covered is None else covered,
                timeline=merge({}, timeline or {}),
            )
            _mark_published(request)
            if self._aborted.pop(request_id, None) is not None:
                return ReleaseReason.ABORTED
            self._early_done.pop(request_id, None)
            early = self._early_reports.pop(request_id, set())
            request.reported.update((engine, rank) for engine, rank, _ in early)
            sizes = {engine: size for engine, _, size in early}
            if early and _all_reported(request, sizes):
                return ReleaseReason.READ
            return None

    def mark_ready(self, request_id: str, tokens: int, layers: int | None = None) -> None:
        """Tokens before `tokens` are computed now: in every layer (`layers` None), or in the
        rank's first `layers` layers (the step under way). Readiness only grows; a layer mark
        of more tokens than the last one keeps the fewer layers of the two for the tokens both
        cover (conservative: a step's layers are marked for its own tokens).

        Raises:
            ValueError: the request is not live, or `tokens` is below what was ready or above
                its length, or a layer mark of the same tokens names fewer layers.
        """
        with self._lock:
            request = self._live.get(request_id)
            where = f"mark_ready({request_id!r})"
            if request is None:
                raise ValueError(
                    f"{where}: not published, or released already; publish it first (with "
                    "ready_tokens for a prefill still running)"
                )
            if not request.ready_tokens <= tokens <= request.num_tokens:
                raise ValueError(
                    f"{where}: tokens {tokens} outside [{request.ready_tokens}, "
                    f"{request.num_tokens}] (what was ready in every layer, the request's "
                    "length); readiness only grows"
                )
            if tokens > request.covered:
                raise ValueError(
                    f"{where}: tokens {tokens} beyond the {request.covered} its block table "
                    "holds; extend the table first (KVProducer.extend)"
                )
            if layers is None:
                request.ready_tokens = tokens
                _mark_published(request, marked=True)
            elif tokens == request.layer_tokens:
                if layers < request.ready_layers:
                    raise ValueError(
                        f"{where}: layers {layers} below the {request.ready_layers} marked for "
                        f"tokens before {tokens}; readiness only grows"
                    )
                request.ready_layers = layers
                _mark_published(request, marked=True)
            elif tokens > request.layer_tokens:
                partial = request.layer_tokens > request.ready_tokens
                request.ready_layers = min(layers, request.ready_layers) if partial else layers
                request.layer_tokens = tokens
                _mark_published(request, marked=True)
            # else: fewer tokens than the last layer mark, in every layer that already covers

    def is_ready(self, request: PublishedRequest, token_end: int, layer_end: int) -> bool:
        """Whether tokens before `token_end` are computed in the rank's layers before
        `layer_end` (local indices)."""
        with self._lock:
            return token_end <= request.ready_tokens or (
                token_end <= request.layer_tokens and layer_end <= request.ready_layers
            )

    def extend(self, request_id: str, block_ids: np.ndarray, covered: int) -> None:
        """The request's block table grew (checked by the caller: `KVProducer.extend`) to hold
        `covered` tokens.

        Raises:
            ValueError: not live.
        """
        with self._lock:
            request = self._live.get(request_id)
            if request is None:
                raise ValueError(f"extend({request_id!r}): not published, or released already")
            request.block_ids = block_ids
            request.covered = max(request.covered, covered)

    def fail(self, request_id: str, reason: str) -> bool:
        """The prefill will not compute the rest of the request. Returns whether it is live."""
        with self._lock:
            request = self._live.get(request_id)
            if request is not None:
                request.failure = reason or "the prefill failed"
            return request is not None

    def timeline(self, request: PublishedRequest) -> dict[str, float]:
        """A copy of the request's timeline so far."""
        with self._lock:
            return dict(request.timeline)

    def get(self, request_id: str) -> PublishedRequest | None:
        """The live request, if published and not released."""
        with self._lock:
            return self._live.get(request_id)

    def was_released(self, request_id: str) -> bool:
        """Whether the id was released (and is still remembered)."""
        with self._lock:
            return request_id in self._released

    def holds(self, request_id: str, generation: int) -> bool:
        """Whether that publication of the request is still live and not failed (its blocks
        untouched: once `fail` returned, the prefill may give them to another request)."""
        with self._lock:
            request = self._live.get(request_id)
            return request is not None and request.generation == generation and not request.failure

    def note_fetcher(self, request_id: str, engine_id: str, engine_size: int) -> None:
        """A session of `engine_id` (`engine_size` ranks: PP x TP) asked for the request."""
        with self._lock:
            request = self._live.get(request_id)
            if request is not None:
                request.fetchers.setdefault(engine_id, engine_size)

    def report_done(self, request_id: str, engine_id: str, rank: int, engine_size: int) -> bool:
        """A rank (engine rank: PP x TP) of a decode engine of `engine_size` ranks is done with
        the request. Returns whether
        the request is now to be released: every rank of every engine that fetched it
        reported (or, when no engine fetched it from this producer, as with MLA or replicated
        heads, every rank of the reporting engine). An engine that did not fetch a request
        others fetch cannot report it done: a stranger cannot free blocks another engine reads.
        """
        with self._lock:
            request = self._live.get(request_id)
            if request is None:
                if request_id not in self._released:  # not published yet: counted then
                    self._early_done[request_id] = time.monotonic() + self._ttl
                    reports = self._early_reports.setdefault(request_id, set())
                    reports.add((engine_id, rank, engine_size))
                    self._forget_old(time.monotonic())
                return False
            if request.fetchers and engine_id not in request.fetchers:
                return False
            request.reported.add((engine_id, rank))
            return _all_reported(request, {engine_id: engine_size})

    def abort(self, request_id: str, engine_id: str) -> bool:
        """`engine_id` will never load the request. Returns whether to release it now: it is
        published and no other engine fetches it. An id not published yet is remembered, and
        its publish releases it at once (a decode engine may abort after the prefill finished,
        before the publish)."""
        with self._lock:
            request = self._live.get(request_id)
            if request is not None:
                return set(request.fetchers) <= {engine_id}
            if request_id not in self._released:
                self._aborted[request_id] = time.monotonic() + self._ttl
                self._forget_old(time.monotonic())
            return False

    def postpone(self, seconds: float) -> None:
        """Move every deadline `seconds` later: the owner's clock thread was not run that long
        (a request's deadline counts the time its producer could serve it)."""
        with self._lock:
            for request in self._live.values():
                request.deadline += seconds

    def expired(self, now: float) -> list[str]:
        """Ids whose deadline passed."""
        with self._lock:
            return [rid for rid, r in self._live.items() if r.deadline <= now]

    def release(self, request_id: str) -> bool:
        """Mark the request released. Returns True exactly once per publication."""
        with self._lock:
            if self._live.pop(request_id, None) is None:
                return False
            self._released[request_id] = time.monotonic() + self._ttl
            self._forget_old(time.monotonic())
            return True

    @property
    def live_count(self) -> int:
        """Published requests not released."""
        with self._lock:
            return len(self._live)

    def pending(self) -> list[str]:
        """Published ids not released, sorted."""
        with self._lock:
            return sorted(self._live)

    @property
    def released_kept(self) -> int:
        """Released (and aborted, unpublished) ids remembered now."""
        with self._lock:
            return len(self._released) + len(self._aborted)

    def _forget_old(self, now: float) -> None:
        for ids in (self._released, self._aborted, self._early_done):
            while ids:
                request_id, forget_at = next(iter(ids.items()))
                if forget_at > now and len(ids) <= self._max_released:
                    break
                del ids[request_id]
        for request_id in [r for r in self._early_reports if r not in self._early_done]:
            del self._early_reports[request_id]


def _all_reported(request: PublishedRequest, reporters: dict[str, int]) -> bool:
    """Whether every rank of every engine that fetched the request reported done (with no
    fetcher: every rank of the engines that reported, `reporters`: engine -> its ranks)."""
    engines = request.fetchers or reporters
    return all(
        len({r for e, r in request.reported if e == engine}) >= size
        for engine, size in engines.items()
    )


def _mark_published(request: PublishedRequest, marked: bool = False) -> None:
    """Note when the request's KV was first offered as computed (tokens ready at its publish,
    or its first `mark_ready`: `marked`) and when all of it was."""
    timeline = request.timeline
    if "first_layer_published" not in timeline and (marked or request.ready_tokens > 0):
        mark(timeline, "first_layer_published")
    if "last_layer_published" not in timeline and request.ready_tokens >= request.num_tokens:
        mark(timeline, "last_layer_published")
