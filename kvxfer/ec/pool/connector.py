"""`PoolECConnector`: the facade that `ECConnectorFactory` creates; it only dispatches by role.

A producer connector runs an `ECProducer` (`producer.py`), a consumer connector an
`ECConsumer` (`consumer.py`); the config is parsed into the role's settings (`config.py`)
first, so a bad key fails before anything binds or registers.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from kvxfer.ec.base import ECConnectorBase
from kvxfer.ec.pool.config import ConsumerSettings, ProducerSettings
from kvxfer.ec.pool.consumer import ECConsumer
from kvxfer.ec.pool.producer import ECProducer


class PoolECConnector(ECConnectorBase):
    """Encoder outputs in a producer's registered pool, pulled by the consumer over a transport
    of `kvxfer.transport.factory.KINDS` (`transport`, Mooncake by default).

    Producer config: `host` (127.0.0.1: side channel and transport bind there), `port` (0: any;
    see `address`), `pool_bytes` (256 MiB), `secret`, `transport` ("mooncake"), `protocol`
    ("tcp" or "rdma"),
    `rdma_fallback` (False), `lease_s` (30: the longest a consumer's read pins an item),
    `max_leases` (64 pinned reads per consumer session), `session_timeout_s` (600: an idle
    session is forgotten; its consumer shakes hands again), `max_sessions` (256).

    Consumer config: `producer_addresses` (list of producer `address`es, "tcp://host:port"),
    `recv_bytes` (256 MiB), `secret`, `timeout_s` (30: one load from one producer),
    `query_timeout_s` (0.5: one round of queries), `retry_after_s` (5: how long a producer that
    did not answer is skipped), `fetch_workers` (4 loads in flight per producer),
    `close_timeout_s` (2: how long `close` waits for reads from a frozen producer to settle),
    `host`, `transport` (the producers' kind), `protocol`, `rdma_fallback`, `name` (for the
    producers' logs).

    Both: `load_workers` (4). The keys, their types and checks are `ProducerSettings` and
    `ConsumerSettings`; a key neither role reads raises `ValueError` naming it.
    """

    def __init__(self, role: str, config: dict[str, Any] | None = None) -> None:
        self._producer: ECProducer | None = None
        self._consumer: ECConsumer | None = None
        settings = _settings(role, config)  # before anything binds or registers
        super().__init__(role, config)  # refuses any other role
        if isinstance(settings, ProducerSettings):
            self._producer = ECProducer(settings)
        else:
            assert isinstance(settings, ConsumerSettings)
            self._consumer = ECConsumer(settings)

    @property
    def producer(self) -> ECProducer:
        """The producer half (producer role only)."""
        self._require("producer", "the producer half")
        assert self._producer is not None
        return self._producer

    @property
    def consumer(self) -> ECConsumer:
        """The consumer half (consumer role only)."""
        self._require("consumer", "the consumer half")
        assert self._consumer is not None
        return self._consumer

    @property
    def address(self) -> str:
        """Where consumers reach this producer: "tcp://host:port" (producer)."""
        return self.producer.address

    @property
    def stored(self) -> list[str]:
        """Hashes held, least recently used first (producer)."""
        return self.producer.pool.stored

    @property
    def producers_down(self) -> list[str]:
        """Producers skipped now because they did not answer (consumer)."""
        return self.consumer.producers_down

    @property
    def quarantined_bytes(self) -> int:
        """Receive-buffer bytes held back from reuse: reads given up on that have not settled
        (consumer)."""
        return self.consumer.buffer.quarantined_bytes

    def stats_snapshot(self) -> dict[str, object]:
        """Live state, for monitoring and leak checks.

        Producer: consumer sessions, leases (pinned, and expired ones remembered to answer a
        late done), items held and pinned, free pool bytes, the transport, threads.
        Consumer: producers skipped now, sessions, receive-buffer bytes quarantined and in use,
        reads in flight, loads pending, threads.
        """
        if self._producer is not None:
            return self._producer.stats()
        return self.consumer.stats()

    def _save(self, mm_hash: str, tensor: torch.Tensor) -> None:
        self.producer.save(mm_hash, tensor)

    def _has(self, mm_hash: str) -> bool:
        return self.consumer.has(mm_hash)

    def _submit(self, mm_hash: str, device: str | torch.device) -> Future[torch.Tensor]:
        return self.consumer.submit(mm_hash, device)

    def _load(self, mm_hash: str) -> torch.Tensor:
        return self.consumer.submit(mm_hash, "cpu").result()

    def _release(self, mm_hash: str) -> None:
        self.consumer.release(mm_hash)

    def _close(self) -> None:
        if self._producer is not None:
            self._producer.close()
        if self._consumer is not None:
            self._consumer.close()


def _settings(
    role: str, config: dict[str, Any] | None
) -> ProducerSettings | ConsumerSettings | None:
    """The role's checked settings (None for a role that is neither: the base refuses it)."""
    if role == "producer":
        return ProducerSettings.from_config(config)
    if role == "consumer":
        return ConsumerSettings.from_config(config)
    return None
