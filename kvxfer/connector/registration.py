"""`CacheRegistration`: a rank's cache tensors registered on a transport that a connector either
created (and closes) or shares with its caller (and leaves open)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvxfer.transport.base import Region, Transport
from kvxfer.transport.mooncake import MooncakeTransport


class CacheRegistration:
    """Registers one region per layer tensor, in layer order.

    Args:
        caches: the layer tensors.
        transport: a transport to share, or None to create a `MooncakeTransport`.
        host, protocol: where and how the created transport runs.
    """

    def __init__(
        self,
        caches: Sequence[torch.Tensor],
        transport: Transport | None,
        host: str,
        protocol: str,
    ) -> None:
        self._owns_transport = transport is None
        self.transport: Transport = transport or MooncakeTransport(host, protocol)
        self.regions: list[Region] = [self.transport.register(t) for t in caches]

    def close(self) -> None:
        """Close the transport if it was created here, else give back only the caches."""
        if self._owns_transport:
            self.transport.close()  # unregisters the caches too
        else:
            for region in self.regions:
                self.transport.unregister(region)
