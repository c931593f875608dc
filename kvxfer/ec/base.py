"""The encoder-cache connector interface: encoder outputs keyed by the hash of their content.

An encoder instance holds the producer role and `save`s one tensor per multimodal item; a
prefill instance holds the consumer role and `has`, `load`s (or `start_load`s in batches) and
finally `release`s them.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Literal

import torch

Role = Literal["producer", "consumer"]
ROLES: tuple[str, ...] = ("producer", "consumer")
_HASH = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


class ECLoadError(RuntimeError):
    """An encoder output could not be loaded (missing, corrupt, or the peer failed)."""


def check_hash(mm_hash: str) -> str:
    """Validate a multimodal item hash: letters, digits, '_', '.', '-' (it names files)."""
    if not isinstance(mm_hash, str) or not _HASH.match(mm_hash) or mm_hash in (".", ".."):
        raise ValueError(
            f"mm_hash: {mm_hash!r} is not a valid item hash; use 1-200 letters, digits, "
            "'_', '.' or '-' (a hex digest of the item's content, for example)"
        )
    return mm_hash


def item_key(identifier: str) -> str:
    """A valid item hash for any identifier: itself when valid, else `id-` and its SHA-256.

    vLLM's identifiers may carry a LoRA prefix (`name:hash`) or be a client's own UUID; both
    sides of a transfer map them the same way.
    """
    if isinstance(identifier, str) and _HASH.match(identifier) and identifier not in (".", ".."):
        return identifier
    return "id-" + hashlib.sha256(str(identifier).encode()).hexdigest()


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (0-d tensors included)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


class ECLoadHandle:
    """A batch of loads in progress: poll `done()`, or `wait()` for every tensor."""

    def __init__(self, futures: dict[str, Future[torch.Tensor]]) -> None:
        self._futures = futures

    @property
    def hashes(self) -> list[str]:
        """The items of the batch."""
        return list(self._futures)

    def done(self) -> bool:
        """Whether every load has finished (successfully or not)."""
        return all(f.done() for f in self._futures.values())

    def finished(self) -> list[str]:
        """Items whose load has finished."""
        return [h for h, f in self._futures.items() if f.done()]

    def wait(self, timeout: float | None = None) -> dict[str, torch.Tensor]:
        """Every tensor of the batch.

        Raises:
            ECLoadError: naming every item that failed, and why.
            TimeoutError: not all loads finished in time.
        """
        results, failures = {}, []
        for mm_hash, future in self._futures.items():
            try:
                results[mm_hash] = future.result(timeout)
            except FutureTimeout as exc:
                raise TimeoutError(f"loading {mm_hash!r} did not finish in {timeout} s") from exc
            except Exception as exc:
                failures.append(f"{mm_hash}: {exc}")
        if failures:
            raise ECLoadError("could not load " + "; ".join(failures))
        return results

    def results(
        self, timeout: float | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Every item's outcome, one failure costing only its own item.

        Returns:
            The tensors that loaded, and for every item that did not, why.

        Raises:
            TimeoutError: not all loads finished in time.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        loaded: dict[str, torch.Tensor] = {}
        failed: dict[str, str] = {}
        for mm_hash, future in self._futures.items():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                loaded[mm_hash] = future.result(left)
            except FutureTimeout as exc:
                raise TimeoutError(f"loading {mm_hash!r} did not finish in {timeout} s") from exc
            except Exception as exc:
                failed[mm_hash] = str(exc) or type(exc).__name__
        return loaded, failed


class ECConnectorBase(ABC):
    """An encoder-cache connector in one role.

    Args:
        role: "producer" (encoder side) or "consumer" (prefill side).
        config: connector-specific settings.
    """

    def __init__(self, role: str, config: dict[str, Any] | None = None) -> None:
        if role not in ROLES:
            raise ValueError(f"role: {role!r} is not one of {list(ROLES)}")
        self.role: Role = role  # type: ignore[assignment]
        self.config = dict(config or {})
        self._loader = ThreadPoolExecutor(
            int(self.config.get("load_workers", 4)), thread_name_prefix="kvxfer-ec-load"
        )
        self._closed = threading.Event()

    def _require(self, role: str, what: str) -> None:
        if self.role != role:
            raise RuntimeError(f"{what} needs the {role} role; this connector is a {self.role}")

    # producer
    def save(self, mm_hash: str, tensor: torch.Tensor) -> None:
        """Store one item's encoder output under its hash."""
        self._require("producer", "save")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor: expected a torch.Tensor, got {type(tensor).__name__}")
        self._save(check_hash(mm_hash), tensor.detach().contiguous())

    # consumer
    def has(self, mm_hash: str) -> bool:
        """Whether the item's encoder output can be loaded now.

        With the built-in connectors a peer's fault (a producer unreachable or frozen, a
        truncated file) is an answer of False, not an exception; a bad `mm_hash` or role
        raises.
        """
        self._require("consumer", "has")
        return self._has(check_hash(mm_hash))

    def load(self, mm_hash: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """Load one item's encoder output (blocking)."""
        return self.start_load([mm_hash], device).wait()[mm_hash]

    def start_load(self, hashes: Sequence[str], device: str | torch.device = "cpu") -> ECLoadHandle:
        """Start loading a batch of items in the background."""
        self._require("consumer", "start_load")
        checked = [check_hash(h) for h in hashes]
        return ECLoadHandle({h: self._submit(h, device) for h in checked})

    def _submit(self, mm_hash: str, device: str | torch.device) -> Future[torch.Tensor]:
        """Start one load (a connector may route it to its own workers)."""
        return self._loader.submit(self._load_to, mm_hash, device)

    def _load_to(self, mm_hash: str, device: str | torch.device) -> torch.Tensor:
        return self._load(mm_hash).to(device)

    def release(self, mm_hash: str) -> None:
        """The consumer no longer needs the item."""
        self._require("consumer", "release")
        self._release(check_hash(mm_hash))

    def close(self) -> None:
        """Stop background work and free resources."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._loader.shutdown(wait=True)
        self._close()

    def __enter__(self) -> ECConnectorBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # what a connector implements
    @abstractmethod
    def _save(self, mm_hash: str, tensor: torch.Tensor) -> None: ...

    @abstractmethod
    def _has(self, mm_hash: str) -> bool: ...

    @abstractmethod
    def _load(self, mm_hash: str) -> torch.Tensor: ...

    def _release(self, mm_hash: str) -> None:  # noqa: B027 (optional hook)
        """Nothing to free by default."""

    def _close(self) -> None:  # noqa: B027 (optional hook)
        """Nothing to free by default."""
