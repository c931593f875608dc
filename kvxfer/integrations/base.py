"""The engine-adapter contract: what an integration with a serving engine supplies to kvxfer.

An adapter is one worker of an engine (a TP rank of a pipeline stage) seen from kvxfer. It owns
a `GroupedProducer` (prefill) or `GroupedConsumer`s (decode) and translates between the engine's
objects and theirs; nothing below it (plans, kernels, sessions, transports) knows an engine.
Its duties, one member each:

- geometry -> spec, `register_kv_caches`: read the worker's KV cache groups (a `KVCacheSpec` and
  the layer tensors each) from the engine's own tensors and configuration; refuse a layout
  kvxfer has not verified, never guess;
- discovery, prefill side, `register`: make the worker's side channels findable;
- discovery, decode side, `look_up`: find a remote engine's side channels, one per rank;
- `publish`: offer a computed (or computing) request's blocks;
- `fetch`: start loading a request's KV into blocks the engine allocated, off its step;
- `abort`: give up a load and tell the prefill engine, which frees the request at once;
- release -> free, `released`: the producer released a request, with its `ReleaseReason`;
  the engine may free its blocks.

`kvxfer.integrations.vllm.worker.WorkerSide` implements it (checked by mypy against vLLM's real
types in `make test-vllm`), and so does `kvxfer.integrations.sglang.manager.KvxferKVManager`,
whose discovery is SGLang's: the prefill's ranks answer a decode rank's registration with the
side channels `register` kept, and `look_up` reads those answers. Adding an engine means one
adapter package under `integrations/` with a class of this shape; its engine's objects are the
type parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Protocol, TypeVar

from kvxfer.connector import ReleaseReason

CachesT_contra = TypeVar("CachesT_contra", contravariant=True)
SendT_contra = TypeVar("SendT_contra", contravariant=True)
LoadT_contra = TypeVar("LoadT_contra", contravariant=True)
AbortT_contra = TypeVar("AbortT_contra", contravariant=True)

RankChannels = tuple[tuple[str, ...], Hashable]
"""A look-up's answer: each rank's side channels (a rank's groups' channels in one string, in
the engine's rank order), and a fingerprint of the registrations they come from: a reconnect
that finds another fingerprint knows the remote engine restarted."""


def rank_channels(addresses: list[str]) -> str:
    """A producer rank's side channels, one per KV cache group, as one string (comma
    separated: addresses hold none), so that ranks compare and log as plain strings."""
    return ",".join(addresses)


def split_channels(channels: str) -> list[str]:
    """The per-group side channels of `rank_channels`."""
    return channels.split(",")


class EngineAdapter(Protocol[CachesT_contra, SendT_contra, LoadT_contra, AbortT_contra]):
    """One worker of an engine, as kvxfer needs it (the module's table says each duty).

    Type parameters: the engine's KV cache tensors as it hands them over, its order to publish
    a request, to load one, and to abort a load.
    """

    @property
    def look_up(self) -> Callable[..., RankChannels]:
        """Discovery, decode side: a remote engine's ranks. Its arguments are the engine's own
        (where its registry is, which engine and DP rank); it blocks, so it runs off the
        engine's step, and raises `LookupError` for ranks not registered by its deadline."""
        ...

    def register_kv_caches(self, caches: CachesT_contra) -> None:
        """Geometry -> spec: read this worker's KV cache groups; a prefill starts serving and
        registers its side channels (`register`)."""
        ...

    def register(self, addresses: list[str]) -> None:
        """Discovery, prefill side: make this worker's side channels (one per group) findable,
        and keep them so while it lives."""
        ...

    def publish(self, send: SendT_contra) -> None:
        """Offer a request's blocks to the decode engines."""
        ...

    def fetch(self, load: LoadT_contra) -> None:
        """Start loading a request's KV; never blocks the engine's step."""
        ...

    def abort(self, abort: AbortT_contra) -> None:
        """Give up a load and tell its prefill engine."""
        ...

    def released(self, request_id: str, reason: ReleaseReason) -> None:
        """The producer released `request_id` (its side-channel thread; must not block): the
        engine may free its blocks. `reason` says why; only `READ` means it was read."""
        ...
