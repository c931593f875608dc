"""The encoder-cache consumer: finds items among its producers and pulls them into its memory.

    query every producer -> pin at one that holds it -> read -> done/valid -> copy out

A query goes to every producer at once and waits `query_timeout_s` (0.5 s) at most; a producer
that did not answer is skipped for `retry_after_s` (5 s), so `has` answers in well under a
second however many producers are down, and never raises for a peer's fault. A load pins the
item at a producer that holds it (`ECPin`; the producer answers where it lies in its
registered pool, with a lease), reads the bytes with the consumer's own transport for
that producer into the receive buffer (`receive.py`), then reports the read (`ECDone`) and
learns whether the item stayed in the pool throughout (`ECValid`). Only then are the bytes
copied out and returned; a load that fails at one producer goes to the next that holds it.
Each producer has its own small pool of fetch threads, so a frozen or hostile producer holds
only its own loads. The conversations with producers are `conversations.py`'s.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import torch

from kvxfer.connector.messages import (
    ECDone,
    ECInfo,
    ECPin,
    ECPinned,
    ECQuery,
    ECRelease,
    ECValid,
    Message,
)
from kvxfer.ec.base import ECLoadError
from kvxfer.ec.pool.config import ConsumerSettings
from kvxfer.ec.pool.conversations import Conversations, Link, PeerClosed, Talk
from kvxfer.ec.pool.pool import ByteRanges
from kvxfer.ec.pool.receive import ReceiveBuffer
from kvxfer.transport.factory import TransportOptions, check_transport_available

log = logging.getLogger(__name__)

_WARN_EVERY_S = 60.0  # a peer's problem is logged at most this often (has is asked often)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ECLoadError(f"unknown dtype {name!r} from the producer")
    return dtype


def _settle(future: Future[torch.Tensor], result: torch.Tensor | BaseException) -> None:
    try:
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
    except InvalidStateError:  # already settled (close() failed it)
        pass


def _found(mm_hash: str) -> Callable[[tuple[Message, Link]], bool]:
    """Whether a query's answer says the producer holds `mm_hash`."""

    def found(result: tuple[Message, Link]) -> bool:
        answer = result[0]
        return isinstance(answer, ECInfo) and answer.found and answer.mm_hash == mm_hash

    return found


@dataclass
class _Load:
    """One item's load, across the producers it tries in turn (one worker at a time has it)."""

    mm_hash: str
    device: str | torch.device
    future: Future[torch.Tensor]
    tried: list[str] = field(default_factory=list)  # producers asked to fetch it, in order
    errors: list[str] = field(default_factory=list)  # why each of them failed


class ECConsumer:
    """The consumer half of `PoolECConnector`.

    Args:
        settings: the consumer's checked config.

    Raises:
        ValueError: an unknown transport.
        ImportError: the transport's library (Mooncake Transfer Engine) is not installed.
        TransferError: protocol "rdma" on a machine without an RDMA device (and no fallback).
    """

    def __init__(self, settings: ConsumerSettings) -> None:
        options = TransportOptions(settings.host, settings.protocol, settings.rdma_fallback)
        check_transport_available(settings.transport, options)
        self.settings = settings
        addresses = settings.producer_addresses
        self._closed = threading.Event()
        self._lock = threading.Lock()  # liveness, warnings, pending loads
        self._down_until = dict.fromkeys(addresses, 0.0)  # skipped until then
        self._warned: dict[tuple[str, str], float] = {}
        self._pending: set[Future[torch.Tensor]] = set()  # loads not settled yet
        self.buffer = ReceiveBuffer(settings.recv_bytes, settings.transport, options, self._closed)
        self.conversations = Conversations(
            addresses,
            settings.secret,
            settings.name,
            settings.transport,
            self._closed,
            self._mark_up,
        )
        self._loader = ThreadPoolExecutor(
            settings.load_workers, thread_name_prefix="kvxfer-ec-load"
        )
        self._fetchers = {
            address: ThreadPoolExecutor(
                settings.fetch_workers, thread_name_prefix="kvxfer-ec-fetch"
            )
            for address in addresses
        }

    @property
    def producers_down(self) -> list[str]:
        """Producers skipped now because they did not answer."""
        now = time.monotonic()
        with self._lock:
            return [a for a, until in self._down_until.items() if until > now]

    def stats(self) -> dict[str, object]:
        """Producers skipped now, sessions, receive-buffer bytes quarantined and in use, reads
        in flight, loads pending, threads."""
        buffer = self.buffer.stats()
        with self._lock:
            pending = len(self._pending)
        return {
            "producers_down": len(self.producers_down),
            "sessions": self.conversations.open_links(),
            **buffer,
            "pending_loads": pending,
            # an engine's completion thread each, and the fetch threads running now
            "threads": self.buffer.engine_count
            + sum(len(getattr(f, "_threads", ())) for f in self._fetchers.values()),
        }

    def has(self, mm_hash: str) -> bool:
        """Whether a live producer holds the item now (False for any peer's fault)."""
        try:
            return self._locate(mm_hash) is not None
        except Exception:  # a peer's fault is never the caller's: the item is just not there
            log.exception("encoder-cache lookup of %s failed", mm_hash)
            return False

    def submit(self, mm_hash: str, device: str | torch.device) -> Future[torch.Tensor]:
        """Start one load: located by the load workers, fetched by the holder's own."""
        future: Future[torch.Tensor] = Future()
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._done)
        self._loader.submit(self._find_then_fetch, _Load(mm_hash, device, future))
        return future

    def release(self, mm_hash: str) -> None:
        """Tell the live producers this consumer is done with the item (a hint: evict it
        first)."""
        for address in self._live():
            self.conversations.hint(address, ECRelease(mm_hash=mm_hash))

    def close(self) -> None:
        """Stop the loads (those pending fail), close the sockets, then the engines once their
        reads settled (`close_timeout_s` at most)."""
        self._closed.set()
        self._loader.shutdown(wait=True, cancel_futures=True)
        for executor in self._fetchers.values():
            executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            pending = list(self._pending)
        for future in pending:  # their fetch was cancelled: nobody waits forever
            _settle(future, ECLoadError("the encoder-cache connector was closed"))
        self.conversations.close()
        self.buffer.close(self.settings.close_timeout_s)

    # ---- liveness -----------------------------------------------------------------------

    def _mark_down(self, address: str, reason: str) -> None:
        retry_after_s = self.settings.retry_after_s
        with self._lock:
            fresh = self._down_until[address] <= time.monotonic()
            self._down_until[address] = time.monotonic() + retry_after_s
        if fresh:
            log.warning(
                "encoder-cache producer %s %s; skipped for %.1f s", address, reason, retry_after_s
            )

    def _mark_up(self, address: str) -> None:
        with self._lock:
            was_down, self._down_until[address] = self._down_until[address], 0.0
        if was_down:
            log.info("encoder-cache producer %s answers again", address)

    def _live(self, exclude: tuple[str, ...] = ()) -> list[str]:
        now = time.monotonic()
        with self._lock:
            return [a for a, until in self._down_until.items() if a not in exclude and until <= now]

    def _warn_once(self, address: str, text: str) -> None:
        """Log a peer's problem at most once a minute (the scheduler asks many times a step)."""
        now = time.monotonic()
        with self._lock:
            if self._warned.get((address, text), -math.inf) > now - _WARN_EVERY_S:
                return
            self._warned[(address, text)] = now
            if len(self._warned) > 1024:
                self._warned.clear()
        log.warning("%s", text)

    # ---- locating -----------------------------------------------------------------------

    def _converse(
        self,
        address: str,
        make: Callable[[int], Message],
        deadline: float,
        link: Link | None = None,
    ) -> tuple[Message, Link]:
        """One session message to one producer (on `link`, or the producer's); its answer and
        the session it went on.

        Raises:
            ECLoadError: refused, unreadable, or no answer by the deadline (the producer is
                then skipped for `retry_after_s`).
        """
        talk = self.conversations.ask(address, make, link)
        results = self.conversations.drive({address: talk}, deadline)
        if address not in results:
            self._mark_down(address, "did not answer in time")
            raise ECLoadError(f"producer {address} did not answer in time")
        result = results[address]
        if isinstance(result, PeerClosed):
            self._mark_down(address, "closed the connection")
        if isinstance(result, Exception):
            raise result
        return result

    def _locate(
        self, mm_hash: str, exclude: tuple[str, ...] = (), problems: list[str] | None = None
    ) -> tuple[str, ECInfo] | None:
        """Ask every live producer at once; the first that holds the item wins. Producers
        that refused or answered nonsense are added to `problems`."""
        candidates = self._live(exclude)
        if not candidates:
            return None
        found = _found(mm_hash)
        talks: dict[str, Talk[tuple[Message, Link]]] = {
            address: self.conversations.ask(address, lambda ref: ECQuery(ref=ref, mm_hash=mm_hash))
            for address in candidates
        }
        timeout_s = self.settings.query_timeout_s
        results = self.conversations.drive(talks, time.monotonic() + timeout_s, found)
        for address, result in results.items():
            if isinstance(result, PeerClosed):
                self._mark_down(address, "closed the connection")
            if isinstance(result, Exception):
                self._warn_once(address, f"encoder cache: {result}")
                if problems is not None:
                    problems.append(str(result))
            elif found(result):
                assert isinstance(result[0], ECInfo)
                return address, result[0]
        if self._closed.is_set():
            return None
        for address in set(candidates) - results.keys():
            self._mark_down(address, f"did not answer a query in {timeout_s} s")
        return None

    # ---- loading ------------------------------------------------------------------------

    def _done(self, future: Future[torch.Tensor]) -> None:
        with self._lock:
            self._pending.discard(future)

    def _find_then_fetch(self, load: _Load) -> None:
        """Locate the item among the producers not tried yet, then fetch it from there."""
        try:
            problems: list[str] = []
            found = self._locate(load.mm_hash, tuple(load.tried), problems)
            if found is None:
                errors = load.errors + problems
                why = "; ".join(errors) if errors else "none holds it"
                raise ECLoadError(f"no producer could serve {load.mm_hash!r}: {why}")
            address, info = found
            load.tried.append(address)
            self._fetchers[address].submit(self._fetch_step, load, info)
        except BaseException as exc:
            _settle(load.future, exc)

    def _fetch_step(self, load: _Load, info: ECInfo) -> None:
        try:
            tensor = self._fetch(load.tried[-1], load.mm_hash, info).to(load.device)
        except ECLoadError as exc:
            load.errors.append(str(exc))
            if self._closed.is_set():
                _settle(load.future, ECLoadError("; ".join(load.errors)))
            else:  # another producer may hold it too
                self._find_then_fetch(load)
            return
        except BaseException as exc:
            _settle(load.future, exc)
            return
        _settle(load.future, tensor)

    def _fetch(self, address: str, mm_hash: str, info: ECInfo) -> torch.Tensor:
        """Pin, read into the receive buffer, confirm, copy out.

        Raises:
            ECLoadError: any failure; nothing of this read lands in memory in use afterwards.
        """
        deadline = time.monotonic() + self.settings.timeout_s
        dtype, shape = self._described(address, mm_hash, info.dtype, info.shape, info.nbytes)
        if info.nbytes == 0:  # an empty tensor: its dtype and shape are all there is
            return torch.empty(shape, dtype=dtype)
        pinned, link = self._converse(
            address, lambda ref: ECPin(ref=ref, mm_hash=mm_hash), deadline
        )
        if not isinstance(pinned, ECPinned) or pinned.mm_hash != mm_hash:
            raise ECLoadError(
                f"producer {address} answered a pin of {mm_hash!r} with something else"
            )
        if not pinned.ok:
            raise ECLoadError(f"producer {address} could not serve {mm_hash!r}: {pinned.reason}")
        dtype, shape = self._described(address, mm_hash, pinned.dtype, pinned.shape, pinned.nbytes)
        nbytes = pinned.nbytes
        offset = self.buffer.reserve(nbytes, deadline)
        try:
            read = self.buffer.read(address, link.endpoint, pinned.address, offset, nbytes)
        except BaseException:
            self.buffer.unreserve(offset, nbytes)
            raise
        try:
            self.buffer.wait_read(read, deadline)
        except FutureTimeout:
            self.buffer.quarantine_until_settled(offset, nbytes, read)
            timeout_s = self.settings.timeout_s
            self._mark_down(address, f"did not deliver a read in {timeout_s} s")
            raise ECLoadError(
                f"producer {address} did not deliver {mm_hash!r} in {timeout_s} s"
            ) from None
        except Exception as exc:  # settled, failed: nothing more lands
            self.buffer.unreserve(offset, nbytes)
            raise ECLoadError(f"reading {mm_hash!r} from producer {address} failed: {exc}") from exc
        try:  # on the session that holds the lease
            valid, _ = self._converse(
                address, lambda ref: ECDone(ref=ref, lease=pinned.lease), deadline, link
            )
            if not isinstance(valid, ECValid) or valid.lease != pinned.lease:
                raise ECLoadError(f"producer {address} answered a done with something else")
            if not valid.ok:
                raise ECLoadError(
                    f"{mm_hash!r} changed at producer {address} while it was read: {valid.reason}"
                )
            data = self.buffer.copy_out(offset, nbytes)
        finally:
            self.buffer.unreserve(offset, nbytes)
        return data.view(dtype).reshape(shape)

    def _described(
        self, address: str, mm_hash: str, dtype_name: str, shape: list[int], nbytes: int
    ) -> tuple[torch.dtype, list[int]]:
        """The dtype and shape a producer gave, checked against its byte count and the
        receive buffer."""
        dtype = _dtype(dtype_name)
        if any(n < 0 for n in shape) or dtype.itemsize * math.prod(shape) != nbytes:
            raise ECLoadError(
                f"producer {address} describes {mm_hash!r} inconsistently: {dtype_name} "
                f"{shape} in {nbytes} bytes"
            )
        if ByteRanges.rounded(nbytes) > self.buffer.capacity:
            raise ECLoadError(
                f"{mm_hash!r}: {nbytes} bytes exceed recv_bytes {self.buffer.capacity}; "
                "raise recv_bytes"
            )
        return dtype, shape
