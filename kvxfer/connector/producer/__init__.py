"""The KV producer: a prefill rank that serves its requests' KV to decode ranks, the consumer's
mirror (`kvxfer.connector.consumer`).

Pull, on request: a consumer rank asks for a chunk of a request (a token range and a
strategy); once the request is published the producer packs it into its staging if the
strategy packs, and answers where to read it. The consumer reads the bytes into its own
staging with the transport, makes sure the source was held all along (a packed chunk's staging
range is held for a time the consumer measures from before its ask; a chunk read from the
cache is confirmed by one more round trip), and only then copies them into its cache. The
producer never writes into a consumer's memory: a peer cannot make it touch memory other than
its own, and no write of it can land late (docs/connectors.md, "No late bytes").

`KVProducer` (in `facade`) is the whole public API; the rest is its machinery, one job a
module. Read them in this order:

- `facade`: `KVProducer`, checking the caller's arguments, and the side-channel loop:
  handshakes, the sessions' messages, ticks (deadlines, silence, holds), releases;
- `states`: the served chunk's states and events, and the one transition table;
- `sessions`: `ConsumerSession` and its `ServedChunk`s, and `ConsumerSession.advance`, the one
  place a served chunk's state changes;
- `serving`: `ChunkServer`: serve now or wait, offer from the cache or pack, lease, answer;
- `packing`: `Packer`: the sessions' staging pools, the packs and their fences.

Which thread owns what (the module docstrings say the same of each part):

- the side channel (`SideChannelServer`, one thread, never blocks): the sessions, every
  served chunk's state and lease, releases, the pools of ended sessions; small CPU packs;
- a worker per session (`ConsumerSession.worker`): one pack at a time: it waits for staging
  room, packs, and posts the result back to the side channel;
- the engine's threads (`publish`, `mark_ready`, `extend`, `fail`): the request table (its
  own lock) and the packs' fences (`Packer`'s lock); they post to the side channel;
- the transport's own: the reads consumers make of this rank's memory.

A session's worker packs one chunk after another into its pool's slots (`staging_slots` of
them), while its consumer reads earlier chunks: the pack of chunk i+1 runs during the read of
chunk i. On CUDA the packs run on the producer's side stream (`kvxfer.connector.streams`),
after the publish's fence, and the worker waits for each pack's own event before posting.
"""

from kvxfer.connector.producer.facade import KVProducer

__all__ = ["KVProducer"]
