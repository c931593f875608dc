"""`PoolECConnector`: encoder outputs served from a bounded registered pool, pulled over a
transport of the factory's (`transport`: Mooncake by default; `kvxfer.transport.factory`).

Pull, as the KV connector (docs/connectors.md, "No late bytes"): the producer never writes into
anybody's memory. A consumer asks a producer to pin an item (`ECPin`); the producer answers
where it lies in its registered pool, with a lease; the consumer reads the bytes with its own
transport into its own receive buffer, then reports the read (`ECDone`) and learns whether
the item stayed in the pool throughout (`ECValid`). Only then are the bytes copied out and
returned.

    query every producer -> pin at one that holds it -> read -> done/valid -> copy out

Hence: a peer can only make the producer touch the producer's own memory, and no byte of a load
lands in the consumer's memory after that load returned or failed, except in a receive range the
load gave up on, which stays out of use until the consumer's own read of it has settled (the
transport's no-late-byte contract; Mooncake fails a read from a frozen peer after 30 s without
progress); never on a timer.

Authentication is the session layer's (`kvxfer.session`, service "ec"): with a `secret`, the
handshake is a challenge-response (HMAC over both sides' nonces, the secret never on the wire,
`kvxfer.session.auth`) and every later frame in either direction carries a MAC under the
session key; every answer echoes its question's `ref`. Without a secret the same exchange runs
with an empty key (docs/encoder-cache.md, "Trust").

Producer: one side-channel thread answers everything at once; leases end after `lease_s`, so a
frozen or vanished consumer cannot pin the pool for longer. Consumer: a query goes to every
producer at once and waits `query_timeout_s` at most; a producer that did not answer is skipped
for `retry_after_s`, so `has` answers in well under a second however many producers are down;
each producer has its own transport and fetch threads on the consumer, so a frozen or
hostile producer holds only its own loads.

Files, in reading order:

- `connector.py`: `PoolECConnector`, the facade the factory creates; dispatches by role.
- `config.py`: `ProducerSettings`, `ConsumerSettings`: every key, its default and its check.
- `pool.py`: `ByteRanges` (aligned first-fit ranges) and `ItemPool`, the producer's items in
  its registered memory, least recently used first.
- `producer.py`: `ECProducer`: the side channel, consumer sessions and leases.
- `consumer.py`: `ECConsumer`: locating items, loads, liveness of producers.
- `conversations.py`: the consumer's sessions and conversations with producers (generators
  over a `SessionClient`, driven over ZeroMQ).
- `receive.py`: the consumer's receive buffer, its quarantine, and one transport per
  producer reading into it.
"""

from kvxfer.ec.pool.config import ConsumerSettings, ProducerSettings
from kvxfer.ec.pool.connector import PoolECConnector
from kvxfer.ec.pool.pool import ByteRanges

__all__ = ["ByteRanges", "ConsumerSettings", "PoolECConnector", "ProducerSettings"]
