"""The Mooncake encoder-cache connector's configuration: typed, checked, errors naming the key."""

from __future__ import annotations

import dataclasses
import os
import socket

import pytest

from kvxfer.ec.pool import ConsumerSettings, ProducerSettings

ADDRESS = "tcp://127.0.0.1:5800"


def test_defaults_are_the_documented_ones():
    producer = ProducerSettings.from_config({})
    assert (producer.host, producer.port, producer.pool_bytes, producer.secret) == (
        "127.0.0.1",
        0,
        256 << 20,
        "",
    )
    assert (producer.lease_s, producer.max_leases) == (30.0, 64)
    assert (producer.session_timeout_s, producer.max_sessions) == (600.0, 256)
    consumer = ConsumerSettings.from_config({"producer_addresses": [ADDRESS]})
    assert consumer.producer_addresses == (ADDRESS,)
    assert (consumer.recv_bytes, consumer.timeout_s, consumer.query_timeout_s) == (
        256 << 20,
        30.0,
        0.5,
    )
    assert (consumer.retry_after_s, consumer.fetch_workers, consumer.close_timeout_s) == (
        5.0,
        4,
        2.0,
    )
    assert consumer.name == f"{socket.gethostname()}:{os.getpid()}"
    assert (consumer.protocol, consumer.rdma_fallback) == ("tcp", False)


def test_one_config_may_serve_both_roles():
    shared = {
        "producer_addresses": ADDRESS,  # one address as a string
        "pool_bytes": 1 << 20,
        "secret": None,
        "lease_s": 3,
        "timeout_s": 2,
        "name": "prefill-0",
    }
    producer = ProducerSettings.from_config(shared)
    assert producer.pool_bytes == 1 << 20 and producer.lease_s == 3.0 and producer.secret == ""
    consumer = ConsumerSettings.from_config(shared)
    assert consumer.producer_addresses == (ADDRESS,) and consumer.timeout_s == 2.0
    assert consumer.name == "prefill-0"
    twice = ConsumerSettings.from_config({"producer_addresses": [ADDRESS, ADDRESS]})
    assert twice.producer_addresses == (ADDRESS,)
    assert dataclasses.is_dataclass(producer)  # frozen, typed
    with pytest.raises(dataclasses.FrozenInstanceError):
        producer.port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("pool_bytes", 0, "positive number of bytes"),
        ("pool_bytes", "4096", "positive number of bytes"),
        ("max_leases", True, "positive integer"),
        ("lease_s", -1, "positive number of seconds"),
        ("retry_after_s", -0.5, "0 or more"),
        ("port", 70000, "1..65535"),
        ("protocol", "udp", "'tcp', 'rdma'"),
        ("rdma_fallback", "yes", "true or false"),
        ("secret", 42, "a string"),
        ("host", "not a host!", "IP address or hostname"),
    ],
)
def test_a_bad_value_names_its_key_and_what_it_accepts(key, value, says):
    with pytest.raises(ValueError, match=rf"\['{key}'\]") as raised:
        ProducerSettings.from_config({key: value})
    assert says in str(raised.value)


def test_unknown_keys_and_bad_addresses_are_named():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['pool_byte'\].*pool_bytes"):
        ProducerSettings.from_config({"pool_byte": 1 << 20})
    with pytest.raises(ValueError, match="needs producer_addresses"):
        ConsumerSettings.from_config({})
    with pytest.raises(ValueError, match=r"\['producer_addresses'\].*'tcp://host:port'"):
        ConsumerSettings.from_config({"producer_addresses": ["127.0.0.1:5800"]})
    with pytest.raises(ValueError, match=r"\['producer_addresses'\].*a list"):
        ConsumerSettings.from_config({"producer_addresses": 5800})
    with pytest.raises(ValueError, match=r"\['recv_bytes'\]"):  # checked for the other role too
        ProducerSettings.from_config({"recv_bytes": 0})
