"""What a producer keeps of each consumer rank that completed the handshake: its
`ConsumerSession`, and in it every chunk the producer serves it (`ServedChunk`), each moved
only by `ConsumerSession.advance` along `kvxfer.connector.producer.states`' table.

Everything here is the side-channel thread's: the loop creates, moves and drops these records;
a session's worker only packs and posts its result back (`kvxfer.connector.producer`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvxfer.connector.messages import TransferRequest
from kvxfer.connector.producer.states import ServedEvent, ServedState, next_state
from kvxfer.connector.staging import StagingPool
from kvxfer.plan import HeadRoute
from kvxfer.spec import KVCacheSpec

ChunkKey = tuple[str, int]  # (request id, chunk id)


@dataclass(eq=False)  # identity: a pack's result finds its own record, even if asked again
class ServedChunk:
    """One chunk a consumer asked for, from its ask until the producer holds nothing of it."""

    ask: TransferRequest
    received: float  # when the ask arrived: a packed chunk's hold is counted from here
    deadline: float  # waiting: when it is answered that its request was not ready in time
    slot: int | None = None  # packing, dropped, leased: its staging range, once taken
    expires: float = 0.0  # leased: when the hold its `ChunkReady` promised ends
    _state: ServedState = ServedState.WAITING

    @property
    def key(self) -> ChunkKey:
        return self.ask.request_id, self.ask.chunk_id

    @property
    def state(self) -> ServedState:
        """Where the chunk stands (changed by `ConsumerSession.advance` only)."""
        return self._state


@dataclass(eq=False)  # identity: compared and hashed as objects
class ConsumerSession:
    """A consumer rank's session (its key, address and last frame are the session layer's
    `ServerSession`, found by `id`), and the chunks served to it."""

    id: str
    engine_id: str
    spec: KVCacheSpec
    route: HeadRoute | None  # the layers and heads this producer serves that rank, if any
    worker: ThreadPoolExecutor  # packs one chunk after another into `pool`
    pool: StagingPool | None = None  # taken at its first pack (`Packer.pool_for`)
    ended: bool = False
    chunks: dict[ChunkKey, ServedChunk] = field(default_factory=dict)  # not settled
    counts: Counter[ServedState] = field(default_factory=Counter)
    recycle_at: float | None = None  # ended: when its pool may be reused (its holds' end)

    @property
    def rank(self) -> int:
        """The consumer's engine rank (its TP rank without pipeline parallelism)."""
        return self.spec.engine_rank

    def add(self, chunk: ServedChunk) -> ServedChunk | None:
        """Keep a newly asked chunk (waiting); returns the record it replaces, asked before
        under the same key and not settled (the caller forgets it: the newest ask stands)."""
        old = self.chunks.get(chunk.key)
        self.chunks[chunk.key] = chunk
        self.counts[chunk.state] += 1
        return old

    def advance(self, chunk: ServedChunk, event: ServedEvent) -> ServedState:
        """Move `chunk` by `event` (the table's move, or `IllegalTransition`); a settled chunk
        leaves the session."""
        new = next_state(chunk.state, event)
        self.counts[chunk.state] -= 1
        chunk._state = new
        if new is ServedState.SETTLED:
            if self.chunks.get(chunk.key) is chunk:
                del self.chunks[chunk.key]
        else:
            self.counts[new] += 1
        return new

    def in_state(self, state: ServedState) -> list[ServedChunk]:
        """The session's chunks in `state`, in the order they were asked for."""
        if not self.counts[state]:
            return []
        return [chunk for chunk in self.chunks.values() if chunk.state is state]

    def of_request(self, request_id: str) -> Iterator[ServedChunk]:
        """The session's chunks of `request_id` (a list: the caller may move them)."""
        yield from [chunk for key, chunk in self.chunks.items() if key[0] == request_id]

    def held_until(self) -> float:
        """When the last hold of a leased range ends (0: none is leased)."""
        return max((c.expires for c in self.in_state(ServedState.LEASED)), default=0.0)
