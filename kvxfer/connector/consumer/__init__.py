"""The KV consumer: a decode rank that fetches requests' KV from the prefill ranks.

`KVConsumer` (in `facade`) is the whole public API; the rest is its machinery, one job a
module. Read them in this order:

- `facade`: `KVConsumer`, checking the caller's arguments and handing work to the loop;
- `results`: `FetchHandle` and `TransferResult`, what a caller holds;
- `states`: the chunk states and events, and the one transition table (its docstring has it);
- `fetches`: a fetch and its chunks, and `Fetch.advance`, the one place a state changes;
- `machine`: `FetchMachine`, which moves chunks: ask, read, confirm, copy, fail;
- `sessions`: `ProducerSessions`: handshakes (`kvxfer.session`), heartbeats, reconnects,
  notices;
- `copies`: `CacheCopier`, the local copies from staging into the cache;
- `loop`: `EventLoop`, the one thread that owns every socket and state machine.

The planning it relies on is pure and lives in `kvxfer.plan`: pairs (`pairs`), fitting them to
the staging slots (`fitting`), and each chunk's read program (`reads`).
"""

from kvxfer.connector.consumer.facade import KVConsumer
from kvxfer.connector.consumer.results import FetchHandle, TransferResult

__all__ = ["FetchHandle", "KVConsumer", "TransferResult"]
