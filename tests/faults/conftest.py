"""Fixtures of the fault suite: a `Rig` of processes, ended after each test whatever happened."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvxfer.testing import Rig


@pytest.fixture
def rig() -> Iterator[Rig]:
    """Processes started through it are ended (SIGKILL if they do not answer) after the test."""
    with Rig() as r:
        yield r
