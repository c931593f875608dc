"""A fetch and its chunks, as the consumer's loop keeps them, and the one place their states
change: `Fetch.advance` (the move from `kvxfer.connector.consumer.states.TRANSITIONS`, plus the
fetch's bookkeeping of that move).

A fetch is cut into chunks per pair (`Fetch.cut`, `FittedPair.cuts`): each of `chunk_tokens`
tokens at most and every layer of the pair, or, streamed, of fewer layers and more tokens;
`advance` keeps what the loop needs at every step in O(1) per chunk, whatever the request's
length: the chunks not asked for yet by producer rank (in token order), the active chunks by
producer rank (the pair's chunks in flight), and how many chunks are not settled yet.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvxfer.connector.consumer.results import FetchHandle
from kvxfer.connector.consumer.states import ChunkEvent, ChunkState, next_state
from kvxfer.connector.timeline import mark, merge
from kvxfer.plan.fitting import ChunkCut, FittedPair
from kvxfer.plan.heads import HeadRoute
from kvxfer.plan.program import CellCopy

if TYPE_CHECKING:  # the records only point at these
    from kvxfer.connector.consumer.sessions import ProducerSession
    from kvxfer.connector.messages import ChunkReady
    from kvxfer.connector.streams import Fence


@dataclass(eq=False)  # identity: compared and hashed as objects
class Chunk:
    """Tokens `[start, end)` of global layers `[layer_start, layer_end)` of one pair of a
    fetch, on their way into the cache."""

    fetch: Fetch
    pair: FittedPair
    chunk_id: int  # unique in the consumer's life: a late answer never matches a newer chunk
    start: int
    end: int
    layer_start: int
    layer_end: int
    route: HeadRoute  # the pair's, narrowed to the chunk's layers
    session: ProducerSession | None = None  # the session it was asked on
    slot: int | None = None  # its staging slot, from `read` until it settles
    read_pending: bool = False  # a read into `slot` has not settled
    asked_at: float = 0.0  # when it was last asked for (a staging hold is timed from here)
    ready: ChunkReady | None = None  # the producer's answer: where to read
    unpack: CellCopy | None = None  # staging -> cache, once read
    nbytes: int = 0
    num_ops: int = 0
    _state: ChunkState = field(default=ChunkState.QUEUED, init=False)

    @property
    def state(self) -> ChunkState:
        """Where the chunk stands (changed by `Fetch.advance` only)."""
        return self._state


@dataclass(eq=False)  # identity: compared and hashed as objects
class Fetch:
    """One `KVConsumer.fetch`: tokens `[start, num_tokens)` of a request into `block_ids`."""

    handle: FetchHandle
    block_ids: np.ndarray
    num_tokens: int
    start: int
    deadline: float
    began: float
    fence: Fence = None  # CUDA: the engine's stream when the fetch began
    streamed: bool = False  # asked for while the prefill may still compute it
    pairs: list[FittedPair] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    queued: dict[int, deque[Chunk]] = field(default_factory=dict)  # by producer rank
    active: dict[int, int] = field(default_factory=dict)  # by producer rank
    waiting: list[Chunk] = field(default_factory=list)  # ready, waiting for a staging slot
    unsettled: int = 0  # chunks neither done nor failed
    # The request's timeline as this rank sees it (`kvxfer.connector.timeline`): its own
    # events and the producers' (with their `ChunkReady`).
    timeline: dict[str, float] = field(default_factory=dict)

    @property
    def request_id(self) -> str:
        """The request being fetched."""
        return self.handle.request_id

    def cut(self, pairs: list[FittedPair], chunk_ids: Iterator[int]) -> list[Chunk]:
        """Cut the fetch into each pair's chunks (all queued), numbered from `chunk_ids`."""
        self.pairs = list(pairs)
        for pair in self.pairs:
            cuts = pair.cuts(self.start, self.num_tokens, self.streamed)
            chunks = [_chunk(self, pair, next(chunk_ids), cut) for cut in cuts]
            self.chunks.extend(chunks)
            self.queued[pair.src_rank] = deque(chunks)
            self.active[pair.src_rank] = 0
        self.unsettled = len(self.chunks)
        self.handle.chunks_total = len(self.chunks)
        return self.chunks

    def ask_limit(self, pair: FittedPair) -> int:
        """Chunks of `pair` asked for at once: its depth, or, streamed, every chunk (the
        producer answers each as soon as its tokens and layers are computed, in whatever order
        they are; the staging slots still bound the reads)."""
        return len(self.chunks) if self.streamed else pair.depth

    def advance(self, chunk: Chunk, event: ChunkEvent) -> ChunkState:
        """Move `chunk` by `event` (the transition table) and keep the fetch's counts and
        queues (O(1), but for a requeue out of token order). Returns the new state.

        Raises:
            IllegalTransition: the table lists no such move.
        """
        was = chunk.state
        state = next_state(was, event)
        if state is was:
            return state
        chunk._state = state
        self._note(chunk, event)
        rank = chunk.pair.src_rank
        self.active[rank] += state.active - was.active
        if state.settled:
            self.unsettled -= 1
        elif state is ChunkState.QUEUED:  # asked again (rare: the producer forgot the session)
            queue = self.queued[rank]
            queue.append(chunk)
            if len(queue) > 1 and queue[-2].chunk_id > chunk.chunk_id:
                self.queued[rank] = deque(sorted(queue, key=lambda c: c.chunk_id))
        return state

    def _note(self, chunk: Chunk, event: ChunkEvent) -> None:
        """Keep the fetch's timeline: the producer's events with its answer, the first read's
        start and the last read's landing."""
        if event is ChunkEvent.OFFERED and chunk.ready is not None:
            merge(self.timeline, chunk.ready.timeline)
            mark(self.timeline, "first_chunk_offered")
        elif event is ChunkEvent.READ:
            mark(self.timeline, "first_byte_read")
        elif event is ChunkEvent.LANDED:
            mark(self.timeline, "last_byte_read")

    def chunks_in(self, state: ChunkState) -> list[Chunk]:
        """Its chunks in `state`."""
        return [c for c in self.chunks if c.state is state]


def _chunk(fetch: Fetch, pair: FittedPair, chunk_id: int, cut: ChunkCut) -> Chunk:
    start, end, first, stop = cut
    return Chunk(fetch, pair, chunk_id, start, end, first, stop, pair.route_of(cut))
