"""The transport protocol: which RDMA devices a machine has (`kvxfer.rdma`), what the connector
setting `protocol: auto` (the default) chooses from them, and that every part asking (settings,
transport, doctor, CLI) reads the same list. Machines with and without RDMA are stood in for by
a directory read in place of /sys/class/infiniband (a parameter, or $KVXFER_INFINIBAND_SYSFS)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvxfer import rdma
from kvxfer.integrations.settings import ConnectorSettings
from kvxfer.rdma import INFINIBAND_SYSFS, SYSFS_ENV, choose_protocol, rdma_devices


@pytest.fixture
def with_rdma(tmp_path):
    """A sysfs directory listing two RDMA devices (created out of order)."""
    for name in ("mlx5_1", "mlx5_0"):
        (tmp_path / name).mkdir()
    return str(tmp_path)


@pytest.fixture
def without_rdma(tmp_path):
    """A machine without the RDMA driver: the directory does not exist."""
    return str(tmp_path / "missing")


def test_devices_are_listed_sorted_from_the_given_directory(with_rdma, without_rdma, tmp_path):
    assert rdma_devices(with_rdma) == ["mlx5_0", "mlx5_1"]
    assert rdma_devices(without_rdma) == []
    (tmp_path / "empty").mkdir()
    assert rdma_devices(str(tmp_path / "empty")) == []


def test_the_environment_variable_replaces_the_sysfs_directory(with_rdma, monkeypatch):
    monkeypatch.delenv(SYSFS_ENV, raising=False)
    assert rdma.infiniband_sysfs() == INFINIBAND_SYSFS == "/sys/class/infiniband"
    monkeypatch.setenv(SYSFS_ENV, with_rdma)
    assert rdma.infiniband_sysfs() == with_rdma
    assert rdma_devices() == ["mlx5_0", "mlx5_1"]


@pytest.mark.parametrize(
    ("requested", "machine", "protocol", "why"),
    [
        pytest.param("auto", "rdma", "rdma", "auto; RDMA devices mlx5_0, mlx5_1", id="auto-rdma"),
        pytest.param("auto", "none", "tcp", "auto; no RDMA device in ", id="auto-none"),
        pytest.param("tcp", "rdma", "tcp", "tcp in the settings", id="tcp-rdma"),
        pytest.param("tcp", "none", "tcp", "tcp in the settings", id="tcp-none"),
        pytest.param("rdma", "rdma", "rdma", "rdma in the settings", id="rdma-rdma"),
        # Kept: the transport refuses it then, naming protocol "tcp" as the fix.
        pytest.param("rdma", "none", "rdma", "rdma in the settings", id="rdma-none"),
    ],
)
def test_the_protocol_chosen_and_why(requested, machine, protocol, why, with_rdma, without_rdma):
    sysfs = with_rdma if machine == "rdma" else without_rdma
    choice = choose_protocol(requested, sysfs)
    assert (choice.protocol, choice.requested, choice.sysfs) == (protocol, requested, sysfs)
    read = machine == "rdma" and requested != "tcp"  # "tcp" reads nothing
    assert choice.devices == (("mlx5_0", "mlx5_1") if read else ())
    assert choice.describe().startswith(f"{protocol} (protocol: ")
    assert why in choice.describe()
    if requested == "auto" and machine == "none":
        assert sysfs in choice.describe()


@pytest.mark.parametrize("requested", ["udp", "RDMA", "", None])
def test_an_unknown_protocol_is_refused(requested):
    with pytest.raises(ValueError, match=r"use one of \['auto', 'tcp', 'rdma'\]"):
        choose_protocol(requested)


def test_the_connector_settings_default_to_auto_and_choose_by_the_machine(
    with_rdma, without_rdma, monkeypatch
):
    settings = ConnectorSettings.from_extra_config({})
    assert settings.protocol == "auto"
    assert settings.transport_protocol(with_rdma).protocol == "rdma"
    assert settings.transport_protocol(without_rdma).protocol == "tcp"
    monkeypatch.setenv(SYSFS_ENV, with_rdma)
    assert settings.transport_protocol().protocol == "rdma"
    monkeypatch.setenv(SYSFS_ENV, without_rdma)
    assert settings.transport_protocol().protocol == "tcp"
    # Explicit protocols are kept whatever the machine has.
    for protocol in ("tcp", "rdma"):
        explicit = ConnectorSettings.from_extra_config({"protocol": protocol})
        assert explicit.protocol == protocol
        assert explicit.transport_protocol(with_rdma).protocol == protocol
        assert explicit.transport_protocol(without_rdma).protocol == protocol
    with pytest.raises(ValueError, match=r"protocol'\] = 'udp'; expected \"auto\", \"tcp\""):
        ConnectorSettings.from_extra_config({"protocol": "udp"})


def test_the_transport_reads_the_same_list(with_rdma, monkeypatch):
    from kvxfer.transport import mooncake

    monkeypatch.setenv(SYSFS_ENV, with_rdma)
    assert mooncake.rdma_devices() == rdma.rdma_devices() == ["mlx5_0", "mlx5_1"]
    assert mooncake._missing_rdma("mlx5_0") is None
    assert "mlx5_9" in str(mooncake._missing_rdma("mlx5_9"))


def test_choosing_imports_nothing_heavy():
    code = (
        "import sys; from kvxfer.rdma import choose_protocol; choose_protocol(); "
        "heavy = [m for m in ('torch', 'numpy', 'mooncake', 'vllm') if m in sys.modules]; "
        "print(heavy)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
