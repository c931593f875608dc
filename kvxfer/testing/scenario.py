"""In-process scenarios: source ranks filled from a global KV, poisoned destination ranks, and
the bytes every destination layer must hold afterwards; `ScenarioEngines`, a connector on every
rank of one, in this process."""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvxfer.reference import converted_global_kv, model_scales, random_global_kv, write_rank_cells
from kvxfer.spec import FP8_DTYPES, KVCacheSpec, allocate_kv_caches
from kvxfer.testing.geometry import random_block_table
from kvxfer.testing.memory import POISON, bits, poison

if TYPE_CHECKING:
    from kvxfer.connector import FetchHandle, KVConsumer, KVProducer

RankCaches = tuple[KVCacheSpec, list[torch.Tensor], np.ndarray]
"""One rank: its spec, its layer tensors and the request's block ids there."""


@dataclass
class Scenario:
    """Source ranks holding a request, poisoned destination ranks, and what they must become."""

    src: list[RankCaches]
    dst: list[RankCaches]
    expected: list[list[torch.Tensor]]
    num_tokens: int
    start_token: int

    def assert_exact(self) -> None:
        """Every destination layer equals its expectation bit for bit, untouched cells too."""
        for (spec, caches, _), expected in zip(self.dst, self.expected, strict=True):
            for layer, (got, want) in enumerate(zip(caches, expected, strict=True)):
                if not torch.equal(bits(got), bits(want)):
                    diff = (bits(got) != bits(want)).nonzero()
                    raise AssertionError(
                        f"destination {spec.rank_name} layer {layer}: "
                        f"{diff.shape[0]} bytes differ, first at byte {diff[0].tolist()}"
                    )

    def assert_untouched(self) -> None:
        """Every destination byte still holds the poison."""
        for spec, caches, _ in self.dst:
            for layer, got in enumerate(caches):
                assert (bits(got) == POISON).all(), f"{spec.rank_name} layer {layer}"


def make_scenario(
    src_specs: list[KVCacheSpec],
    dst_specs: list[KVCacheSpec],
    num_tokens: int,
    start_token: int = 0,
    seed: int = 0,
    contiguous: bool = False,
) -> Scenario:
    """Fill sources with noise plus the request's KV; poison destinations; compute expectations
    (between two KV dtypes: the request's KV as the destination's engine would store it,
    `converted_global_kv` with the fp8 side's scales and the destination's fp8 rounding)."""
    rng = np.random.default_rng(seed)
    kv = random_global_kv(src_specs[0], num_tokens, seed=seed)
    want_kv = kv
    if dst_specs[0].dtype != src_specs[0].dtype:
        fp8_side = src_specs if src_specs[0].dtype in FP8_DTYPES else dst_specs
        scales = model_scales(fp8_side) if fp8_side[0].dtype in FP8_DTYPES else None
        rounding = dst_specs[0].fp8_rounding
        want_kv = converted_global_kv(kv, dst_specs[0].torch_dtype, scales, rounding)
    src, dst, expected = [], [], []
    for spec in src_specs:
        caches = allocate_kv_caches(spec)
        for t in caches:
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(seed + 7)))
        ids = random_block_table(spec, num_tokens, rng, contiguous)
        write_rank_cells(spec, caches, ids, kv, 0, num_tokens)
        src.append((spec, caches, ids))
    for spec in dst_specs:
        caches = allocate_kv_caches(spec)
        poison(caches)
        ids = random_block_table(spec, num_tokens, rng, contiguous)
        want = [t.clone() for t in caches]
        write_rank_cells(spec, want, ids, want_kv, start_token, num_tokens)
        dst.append((spec, caches, ids))
        expected.append(want)
    return Scenario(src, dst, expected, num_tokens, start_token)


class ScenarioEngines:
    """A `KVProducer` on every source rank of `scenario` and a `KVConsumer` on every
    destination rank, in this process, made with the given keywords; `close` (or leaving the
    `with` block) closes them, consumers first. The request is the scenario's: `publish` and
    `fetch` pass every rank its block ids and `num_tokens`."""

    def __init__(
        self,
        scenario: Scenario,
        producer: dict[str, Any] | None = None,
        consumer: dict[str, Any] | None = None,
    ) -> None:
        from kvxfer.connector import KVConsumer, KVProducer

        self.scenario = scenario
        self.producers: list[KVProducer] = []
        self.consumers: list[KVConsumer] = []
        self._producer = producer or {}
        try:
            for spec, caches, _ in scenario.src:
                options = self.producer_options(spec)
                self.producers.append(KVProducer(spec, caches, "prefill", **options))
            for spec, caches, _ in scenario.dst:
                self.consumers.append(KVConsumer(spec, caches, "decode", **(consumer or {})))
        except BaseException:
            self.close()
            raise

    def producer_options(self, spec: KVCacheSpec) -> dict[str, Any]:
        """The keywords of the producer on `spec`'s rank: `producer`, the same on every rank
        (a subclass may vary them by rank)."""
        return self._producer

    @property
    def addresses(self) -> list[str]:
        """Every producer's address, by source rank."""
        return [p.address for p in self.producers]

    def connect(self, **options: Any) -> None:
        """Connect every consumer to every producer (`KVConsumer.connect` keywords)."""
        for consumer in self.consumers:
            consumer.connect(self.addresses, **options)

    def publish(self, request_id: str, **options: Any) -> None:
        """Publish the request on every source rank (`KVProducer.publish` keywords)."""
        for producer, (_, _, ids) in zip(self.producers, self.scenario.src, strict=True):
            producer.publish(request_id, ids, self.scenario.num_tokens, **options)

    def fetch(self, request_id: str, **options: Any) -> list[FetchHandle]:
        """Start fetching the request on every destination rank (`KVConsumer.fetch`
        keywords): the handles, by destination rank."""
        return [
            consumer.fetch(request_id, ids, self.scenario.num_tokens, **options)
            for consumer, (_, _, ids) in zip(self.consumers, self.scenario.dst, strict=True)
        ]

    def close(self) -> None:
        """Close every consumer, then every producer."""
        for consumer in self.consumers:
            consumer.close()
        for producer in self.producers:
            producer.close()

    def __enter__(self) -> ScenarioEngines:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
