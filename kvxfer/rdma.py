"""Which RDMA devices this machine has, and the Mooncake protocol that `"auto"` stands for.

One answer for every part that asks: the transport (`kvxfer.transport.mooncake` refuses RDMA
without a device), the connector settings (`protocol: auto`), `kvxfer doctor` and the CLI. It
reads sysfs only: no torch, Mooncake or libibverbs is imported or loaded, so it is cheap enough
for a command's argument checks and safe in any process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

INFINIBAND_SYSFS = "/sys/class/infiniband"
"""Where Linux lists RDMA devices (InfiniBand, RoCE, iWARP), one entry per device."""

SYSFS_ENV = "KVXFER_INFINIBAND_SYSFS"
"""Environment variable naming another directory to read instead (a container that mounts the
host's sysfs elsewhere; tests that stand in for a machine with or without RDMA)."""

PROTOCOLS: tuple[str, ...] = ("auto", "tcp", "rdma")
"""What a user may ask for: `auto` is RDMA when this machine has an RDMA device, else TCP."""


def infiniband_sysfs() -> str:
    """The directory `rdma_devices` reads: `$KVXFER_INFINIBAND_SYSFS` when set, else
    `/sys/class/infiniband`."""
    return os.environ.get(SYSFS_ENV) or INFINIBAND_SYSFS


def rdma_devices(sysfs: str | None = None) -> list[str]:
    """The RDMA devices of this machine (e.g. `["mlx5_0", "mlx5_1"]`), sorted; `[]` when none.

    Args:
        sysfs: the directory to list (default: `infiniband_sysfs()`).
    """
    try:
        return sorted(os.listdir(sysfs or infiniband_sysfs()))
    except OSError:  # no such directory: no RDMA driver loaded, no device
        return []


@dataclass(frozen=True)
class ProtocolChoice:
    """The Mooncake protocol a transport will run, and why.

    Attributes:
        protocol: "tcp" or "rdma".
        requested: what the settings asked for: "auto", "tcp" or "rdma".
        devices: the RDMA devices found (read only for "auto" and "rdma").
        sysfs: the directory they were read from.
    """

    protocol: str
    requested: str
    devices: tuple[str, ...]
    sysfs: str

    def describe(self) -> str:
        """One line for a log: the protocol and what decided it."""
        if self.requested != "auto":
            return f"{self.protocol} (protocol: {self.requested} in the settings)"
        if self.devices:
            return f"{self.protocol} (protocol: auto; RDMA devices {', '.join(self.devices)})"
        return f"{self.protocol} (protocol: auto; no RDMA device in {self.sysfs})"


def choose_protocol(requested: str = "auto", sysfs: str | None = None) -> ProtocolChoice:
    """The protocol for `requested`: "tcp" and "rdma" as asked; "auto" is "rdma" when
    `rdma_devices(sysfs)` lists a device, "tcp" otherwise.

    An explicit "rdma" is kept without a device: the transport then refuses it with the fix.

    Raises:
        ValueError: `requested` is not one of "auto", "tcp", "rdma".
    """
    if requested not in PROTOCOLS:
        raise ValueError(
            f"protocol: {requested!r} is not supported; use one of {list(PROTOCOLS)} "
            '("auto": RDMA when this machine has an RDMA device, else TCP)'
        )
    where = sysfs or infiniband_sysfs()
    devices = tuple(rdma_devices(where)) if requested != "tcp" else ()
    if requested == "auto":
        return ProtocolChoice("rdma" if devices else "tcp", requested, devices, where)
    return ProtocolChoice(requested, requested, devices, where)
