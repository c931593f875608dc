"""`CacheRegistration`: a rank's cache tensors registered on a transport that a connector either
created (and closes) or shares with its caller (and leaves open)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvxfer.transport.base import Region, Transport
from kvxfer.transport.factory import DEFAULT_KIND, TransportOptions, create_transport

log = logging.getLogger(__name__)


class CacheRegistration:
    """Registers one region per layer tensor, in layer order; all or nothing.

    Args:
        caches: the layer tensors.
        transport: a transport to share, or the kind of one to create
            (`kvxfer.transport.factory.KINDS`; None: Mooncake's).
        host, protocol: where and how the created transport runs.
        rdma_fallback: for the created transport: run TCP (with a warning) when
            protocol="rdma" is unavailable, instead of raising.
        driven: the created transport has no thread: its owner drives it
            (`Transport.drive`).

    Raises:
        ValueError, TransferError: the transport could not be created or a tensor could not
            be registered (e.g. not contiguous). Nothing is left behind then: the regions
            registered so far are unregistered and a transport created here is closed.
    """

    def __init__(
        self,
        caches: Sequence[torch.Tensor],
        transport: Transport | str | None,
        host: str,
        protocol: str,
        *,
        rdma_fallback: bool = False,
        driven: bool = False,
    ) -> None:
        self._owns_transport = transport is None or isinstance(transport, str)
        if transport is None or isinstance(transport, str):
            options = TransportOptions(host, protocol, rdma_fallback, driven)
            transport = create_transport(transport or DEFAULT_KIND, options)
        self.transport: Transport = transport
        self.regions: list[Region] = []
        try:
            for tensor in caches:
                self.regions.append(self.transport.register(tensor))
        except BaseException:
            self._release()
            raise

    def close(self) -> None:
        """Close the transport if it was created here, else give back only the caches."""
        self._release()

    def _release(self) -> None:
        """Close an owned transport (which ends its registrations), else unregister every
        region registered here (all, even if one fails)."""
        regions, self.regions = self.regions, []
        if self._owns_transport:
            # No unregister first: closing ends transfers still in flight, then registrations.
            self.transport.close()
            return
        for region in regions:
            try:
                self.transport.unregister(region)
            except Exception:
                log.exception("unregistering region %d failed", region.region_id)
