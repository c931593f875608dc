"""Checks of network addresses given by users and peers (hosts, side-channel addresses,
transport endpoints) with errors that say the fix, and free local ports (`free_port`).
Standard library only: the bootstrap service, which imports no torch, checks registrations with
them; `kvxfer.validation` re-exports them beside its checks of caches and block tables."""

from __future__ import annotations

import ipaddress
import random
import re
import socket

_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)\Z")


def _host_problem(host: str) -> str | None:
    """Why `host` is neither an IP literal nor a hostname, or None when it is fine.

    An IPv6 literal comes in brackets (`[::1]`), as in URLs and ZeroMQ endpoints.
    """
    if not host:
        return "the host is empty"
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"{host} is not a valid IPv6 address"
        return None
    if ":" in host:
        return f"{host} is an IPv6 address without brackets (write [{host}])"
    labels = host.split(".")
    if labels[-1].isdigit():  # all-numeric top label: only an IPv4 literal is meant
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return f"{host} is not a valid IPv4 address"
        return None
    if len(host) > 253 or not all(_LABEL.match(label) for label in labels):
        return f"{host!r} is not a valid hostname or IP address"
    return None


def check_host(host: object, where: str = "host") -> str:
    """Check a host: an IPv4 literal, a bracketed or bare IPv6 literal, or a hostname.

    Returns:
        The host, unchanged.

    Raises:
        ValueError: naming `where`, the problem and the fix.
    """
    if not isinstance(host, str):
        raise ValueError(
            f"{where}: must be a str like '127.0.0.1', got {host!r} of type "
            f"{type(host).__name__}; pass the address peers reach this machine at"
        )
    bare_v6 = ":" in host and not host.startswith("[")
    problem = _host_problem(f"[{host}]" if bare_v6 else host)
    if problem:
        raise ValueError(
            f"{where}: {problem}; pass an IP address or hostname of this machine, e.g. 127.0.0.1"
        )
    return host


def _split_host_port(text: str) -> tuple[str, str] | None:
    """`(host, port)` split at the last colon (after `]` for an IPv6 literal), or None."""
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or text[end + 1 : end + 2] != ":":
            return None
        return text[: end + 1], text[end + 2 :]
    host, sep, port = text.rpartition(":")
    if not sep:
        return None
    return host, port  # an unbracketed IPv6 host is reported by _host_problem


def _port_problem(port: str) -> str | None:
    if not port.isascii() or not port.isdigit():
        return f"the port {port!r} is not a number"
    if not 1 <= int(port) <= 65535:
        return f"the port {int(port)} is outside 1..65535"
    return None


def _host_port_problems(host: str, port: str) -> str:
    """Every problem of a host and a port, joined ("" when both are fine)."""
    return " and ".join(p for p in (_host_problem(host), _port_problem(port)) if p)


def check_side_channel_address(address: object) -> str:
    """Check a producer's side-channel address: `"tcp://HOST:PORT"`.

    HOST is an IPv4 literal, a bracketed IPv6 literal (`tcp://[::1]:5700`) or a hostname; PORT
    is in 1..65535. This is the form `KVProducer.address` gives.

    Returns:
        The address, unchanged.

    Raises:
        ValueError: not a str, no `tcp://` scheme (the message shows the address with it),
            another scheme, a bind-only wildcard host, a bad host or port.
    """
    if not isinstance(address, str):
        raise ValueError(
            f"address: must be a str like 'tcp://127.0.0.1:5700', got {address!r} of type "
            f"{type(address).__name__}; pass the producer's .address"
        )
    if not address:
        raise ValueError(
            "address: is empty; pass the producer's .address, e.g. 'tcp://127.0.0.1:5700'"
        )
    if address != address.strip():
        raise ValueError(f"address: {address!r} has surrounding whitespace; pass it stripped")
    scheme, sep, rest = address.partition("://")
    if not sep:
        if _split_host_port(address) is not None:
            raise ValueError(
                f"address: {address!r} has no scheme; write tcp://{address} (the producer's "
                ".address has this form)"
            )
        raise ValueError(
            f"address: {address!r} is not a side-channel address; write tcp://HOST:PORT, e.g. "
            "tcp://127.0.0.1:5700 (the producer's .address)"
        )
    if scheme != "tcp":
        example = f"tcp://{rest}" if _split_host_port(rest) else "tcp://HOST:PORT"
        raise ValueError(
            f"address: scheme {scheme + '://'!r} in {address!r} is not supported; producers "
            f"listen on TCP only, write {example}"
        )
    parts = _split_host_port(rest)
    if parts is None:
        raise ValueError(
            f"address: {address!r} has no port; write tcp://HOST:PORT, e.g. tcp://127.0.0.1:5700"
        )
    host, port = parts
    if host == "*":
        raise ValueError(
            f"address: {address!r} is a bind address (any interface); connect to an address "
            f"the producer is reachable at, e.g. tcp://127.0.0.1:{port}"
        )
    problem = _host_port_problems(host, port)
    if problem:
        raise ValueError(
            f"address: {address!r}: {problem}; write tcp://HOST:PORT with a valid host and a "
            "port in 1..65535, e.g. tcp://127.0.0.1:5700"
        )
    return address


def check_transport_endpoint(endpoint: object) -> str:
    """Check a Mooncake transport endpoint: `"HOST:PORT"` (e.g. `"127.0.0.1:15321"`).

    HOST is an IPv4 literal, a bracketed IPv6 literal or a hostname; PORT is in 1..65535. No
    scheme: this is the engine's RPC endpoint, not a side-channel address.

    Returns:
        The endpoint, unchanged.

    Raises:
        ValueError: not a str, a scheme given, a bad host or port.
    """
    if not isinstance(endpoint, str):
        raise ValueError(
            f"endpoint: must be a str like '127.0.0.1:15321', got {endpoint!r} of type "
            f"{type(endpoint).__name__}; pass the transport's .endpoint"
        )
    if "://" in endpoint:
        raise ValueError(
            f"endpoint: {endpoint!r} has a scheme; a transport endpoint is HOST:PORT, e.g. "
            f"{endpoint.partition('://')[2]}"
        )
    parts = _split_host_port(endpoint)
    problem = "it is not HOST:PORT" if parts is None else _host_port_problems(*parts)
    if problem:
        raise ValueError(
            f"endpoint: {endpoint!r}: {problem}; a transport endpoint is HOST:PORT with a valid "
            "host and a port in 1..65535, e.g. 127.0.0.1:15321"
        )
    return endpoint


LOCAL_HOST = "127.0.0.1"
# Ports handed out by `free_port`: see its docstring.
PORTS = (20000, 32767)
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now, outside the kernel's ephemeral range,
    never handed out before by this process (for the servers that tests, scripts and the demo
    start).

    Ports are handed out below the kernel's ephemeral range (32768-60999 by default): the kernel's
    own choices (port 0, which vLLM's internal sockets and Mooncake's take) never land there, so a
    port chosen here and bound a moment later by a server cannot be taken meanwhile. From the
    kernel's choice, an engine's bootstrap port was taken by another engine starting beside it
    ("Address already in use"). Mooncake picks 15000-17000: above that.

    Raises:
        RuntimeError: 1,000 tries found none.
    """
    rng = random.Random()
    for _ in range(1000):
        port = rng.randint(*PORTS)
        if port in _handed_out or not _bindable(port):
            continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {PORTS} after 1,000 tries")


def free_port_run(count: int) -> int:
    """The first of `count` consecutive free ports on 127.0.0.1 (`free_port`'s range and
    rules), for an engine whose workers listen at a base port plus their rank.

    Raises:
        RuntimeError: 1,000 tries found no such run.
    """
    rng = random.Random()
    for _ in range(1000):
        base = rng.randint(PORTS[0], PORTS[1] - count + 1)
        run = range(base, base + count)
        if _handed_out.intersection(run) or not all(_bindable(port) for port in run):
            continue
        _handed_out.update(run)
        return base
    raise RuntimeError(f"no {count} consecutive free ports in {PORTS} after 1,000 tries")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((LOCAL_HOST, port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports (`free_port`)."""
    return [free_port() for _ in range(count)]


def unused_address() -> str:
    """A side-channel address nothing listens on: `tcp://127.0.0.1:<free_port()>`."""
    return f"tcp://{LOCAL_HOST}:{free_port()}"
