"""The entry point SGLang's plugin loader runs (`sglang.srt.plugins`, registered by kvxfer's
`pyproject.toml`): it adds the transfer backend `kvxfer` through SGLang's public plugin API,
patching no line of SGLang.

- `add_disagg_transfer_backend_choices` lets `--disaggregation-transfer-backend kvxfer` parse;
- `TransferBackend` (a closed Enum) gains the member `KVXFER`, so the schedulers' and the
  bootstrap service's `TransferBackend("kvxfer")` resolves. The member is added to the Enum in
  place: a replaced Enum class would leave the modules that imported the old one comparing
  against other members;
- an AROUND hook on `get_kv_class` (`HookRegistry`, which also rebinds the modules that
  imported it) answers kvxfer's manager, sender, receiver and bootstrap server for `KVXFER`, and
  leaves every other backend to SGLang;
- an AFTER hook on `ModelRunner.load_model` records the model's fp8 KV scales and sliding
  window (`kvxfer.integrations.sglang.loaded`), which the manager's specs and groups carry.

SGLang runs `load_plugins()` in `launch_server`, `sglang serve`, the engine, and every scheduler
process, so every process that builds a backend has it.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

BACKEND = "kvxfer"
# SGLang versions whose Common* classes, plugin API and pools this backend was verified
# against (tests/integration_sglang); the classes it subclasses change between releases.
SUPPORTED_SGLANG = ("0.5.23",)
# Where the plugin records the model's fp8 KV scales and sliding window
# (`kvxfer.integrations.sglang.loaded`).
LOAD_MODEL = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"


def check_sglang_version() -> str:
    """The installed SGLang's version, if supported.

    Raises:
        RuntimeError: SGLang is missing or not a supported version, naming the fix.
    """
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(
            f"kvxfer's SGLang backend needs SGLang {' or '.join(SUPPORTED_SGLANG)}: "
            f"pip install 'kvxfer[sglang]'"
        ) from None
    if version not in SUPPORTED_SGLANG:
        raise RuntimeError(
            f"kvxfer's SGLang backend supports SGLang {', '.join(SUPPORTED_SGLANG)}, found "
            f"{version}: install a supported SGLang (pip install 'kvxfer[sglang]'), or another "
            "kvxfer release for this one"
        )
    return version


def register() -> None:
    """Add the transfer backend `kvxfer` (the module docstring). Idempotent.

    Raises:
        RuntimeError: an unsupported SGLang version (`check_sglang_version`).
    """
    check_sglang_version()
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    _add_enum_member(utils.TransferBackend, "KVXFER", BACKEND)
    from kvxfer.integrations.sglang.loaded import after_load_model

    for target, hook, kind in (
        ("sglang.srt.disaggregation.utils.get_kv_class", _get_kv_class, HookType.AROUND),
        (LOAD_MODEL, after_load_model, HookType.AFTER),
    ):
        if not any(h is hook for _, h, _ in HookRegistry._hooks.get(target, ())):
            HookRegistry.register(target, hook, kind)


def _add_enum_member(enum_cls: Any, name: str, value: str) -> None:
    """Add a member to an existing Enum class, keeping its other members' identity."""
    if value in enum_cls._value2member_map_:
        return
    member = object.__new__(enum_cls)
    member._name_, member._value_ = name, value
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    type.__setattr__(enum_cls, name, member)


def _get_kv_class(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    """SGLang's `get_kv_class`, answering kvxfer's classes for the `kvxfer` backend."""
    from sglang.srt.disaggregation.utils import KVClassType

    if getattr(transfer_backend, "value", None) != BACKEND or class_type == KVClassType.KVARGS:
        return original(transfer_backend, class_type)
    from kvxfer.integrations.sglang import conn

    return {
        KVClassType.MANAGER: conn.KvxferKVManager,
        KVClassType.SENDER: conn.KvxferKVSender,
        KVClassType.RECEIVER: conn.KvxferKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: conn.KvxferKVBootstrapServer,
    }[class_type]
