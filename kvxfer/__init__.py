"""kvxfer: move LLM KV caches between differently sharded prefill and decode engines.

The public names below are imported on first use (PEP 562), so `import kvxfer.cli` and the
`kvxfer` command's `--help` do not pay for torch, Triton and Mooncake.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvxfer.connector import (
        FetchHandle,
        KVConsumer,
        KVProducer,
        ReleaseReason,
        TransferResult,
    )
    from kvxfer.plan import STRATEGIES, CostModel, PairPlan, plan_pairs
    from kvxfer.reshard import PairReport, ReshardResult, reshard
    from kvxfer.spec import KVCacheSpec, allocate_kv_caches, decode_spec, encode_spec

_MODULES: dict[str, str] = {
    "FetchHandle": "kvxfer.connector",
    "KVConsumer": "kvxfer.connector",
    "KVProducer": "kvxfer.connector",
    "ReleaseReason": "kvxfer.connector",
    "TransferResult": "kvxfer.connector",
    "STRATEGIES": "kvxfer.plan",
    "CostModel": "kvxfer.plan",
    "PairPlan": "kvxfer.plan",
    "plan_pairs": "kvxfer.plan",
    "PairReport": "kvxfer.reshard",
    "ReshardResult": "kvxfer.reshard",
    "reshard": "kvxfer.reshard",
    "KVCacheSpec": "kvxfer.spec",
    "allocate_kv_caches": "kvxfer.spec",
    "decode_spec": "kvxfer.spec",
    "encode_spec": "kvxfer.spec",
}

__all__ = [
    "STRATEGIES",
    "CostModel",
    "FetchHandle",
    "KVCacheSpec",
    "KVConsumer",
    "KVProducer",
    "PairPlan",
    "PairReport",
    "ReleaseReason",
    "ReshardResult",
    "TransferResult",
    "allocate_kv_caches",
    "decode_spec",
    "encode_spec",
    "plan_pairs",
    "reshard",
]


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'kvxfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """`kvxfer.reshard` is the function, as with eager imports: importing the submodule
    `kvxfer.reshard` would otherwise bind the module to the package's attribute."""

    def __setattr__(self, name: str, value: Any) -> None:
        if (
            name in _MODULES
            and isinstance(value, types.ModuleType)
            and value.__name__ == f"{__name__}.{name}"
        ):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
