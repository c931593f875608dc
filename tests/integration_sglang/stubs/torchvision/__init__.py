"""A stand-in for torchvision in the SGLang test environment (`make test-sglang`).

SGLang imports torchvision at module level from its multimodal configs and processors, which
`sglang.srt.disaggregation.utils` pulls in through `sglang.srt.configs`. PyPI's torchvision
builds pin a CUDA torch, not this machine's CPU build, and a text model never calls it. The
Makefile puts this folder on PYTHONPATH for the suite only: every `torchvision...` module is
this stand-in, any name in it imports, and using one raises, naming why.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

_WHY = (
    "torchvision is a stand-in in kvxfer's SGLang test environment "
    "(tests/integration_sglang/stubs); install a torchvision built for this torch to use it"
)


class _Unavailable:
    """Any attribute of a stand-in module: imports, reads as more of itself, never runs."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Unavailable:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name}: {_WHY}")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)  # `class X(torchvision.Something)` still defines X


def _module_getattr(module_name: str):
    def __getattr__(attr: str) -> _Unavailable:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{module_name}.{attr}")

    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name, _WHY)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


__version__ = "0.0.0+stand-in"
__path__: list[str] = []  # submodules come from the finder, not from this folder
__getattr__ = _module_getattr(__name__)
sys.meta_path.insert(0, _Finder())
