"""The SGLang manager keeps the engine-adapter contract (`kvxfer.integrations.base`): every
member the contract names, with the contract's parameters. mypy cannot tell here (SGLang's
classes are untyped to it, so the manager derives from Any): this checks the members
themselves; the transfer tests run them."""

from __future__ import annotations

import inspect

from kvxfer.integrations.base import EngineAdapter
from kvxfer.integrations.sglang.manager import KvxferKVManager


def _contract_members() -> dict[str, object]:
    return {
        name: member
        for name, member in vars(EngineAdapter).items()
        if not name.startswith("_") and (callable(member) or isinstance(member, property))
    }


def _parameters(function: object) -> list[str]:
    return list(inspect.signature(function).parameters)  # type: ignore[arg-type]


def test_the_manager_has_every_member_of_the_contract_with_its_parameters():
    members = _contract_members()
    assert set(members) == {
        "look_up", "register_kv_caches", "register", "publish", "fetch", "abort", "released"
    }  # fmt: skip
    for name, member in members.items():
        own = inspect.getattr_static(KvxferKVManager, name)
        if isinstance(member, property):
            assert isinstance(own, property), f"{name}: the contract's is a property"
            continue
        assert _parameters(own) == _parameters(member), name
