"""`ECConnectorFactory`: encoder-cache connectors by name, imported only when created."""

from __future__ import annotations

import importlib
import threading
from typing import Any, ClassVar

from kvxfer.ec.base import ECConnectorBase


class ECConnectorFactory:
    """A registry of connector classes: name -> (module path, class name)."""

    _registry: ClassVar[dict[str, tuple[str, str]]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def register(cls, name: str, module_path: str, class_name: str) -> None:
        """Make `name` create `module_path.class_name` (imported lazily, on `create`).

        Raises:
            ValueError: `name` is registered already to another class.
        """
        with cls._lock:
            known = cls._registry.get(name)
            if known is not None and known != (module_path, class_name):
                raise ValueError(f"EC connector {name!r} is already registered as {known}")
            cls._registry[name] = (module_path, class_name)

    @classmethod
    def names(cls) -> list[str]:
        """Registered connector names."""
        with cls._lock:
            return sorted(cls._registry)

    @classmethod
    def create(
        cls,
        name: str,
        role: str,
        config: dict[str, Any] | None = None,
        module_path: str | None = None,
    ) -> ECConnectorBase:
        """Create a connector in `role` ("producer" or "consumer").

        Args:
            name: a registered name, or, with `module_path`, a class name in that module (a
                user's own connector).
            role: "producer" or "consumer".
            config: the connector's settings.
            module_path: import the class `name` from this module instead of the registry.

        Raises:
            ValueError: unknown name, or a class that is not an `ECConnectorBase`.
            ImportError: the module cannot be imported.
        """
        if module_path is None:
            with cls._lock:
                entry = cls._registry.get(name)
            if entry is None:
                raise ValueError(
                    f"unknown EC connector {name!r}; registered: {cls.names()} "
                    "(or pass module_path for your own class)"
                )
            module_path, class_name = entry
        else:
            class_name = name
        module = importlib.import_module(module_path)
        connector = getattr(module, class_name, None)
        if not (isinstance(connector, type) and issubclass(connector, ECConnectorBase)):
            raise ValueError(f"{module_path}.{class_name} is not an ECConnectorBase subclass")
        return connector(role, config or {})


ECConnectorFactory.register(
    "SharedStorageECConnector", "kvxfer.ec.shared_storage", "SharedStorageECConnector"
)
ECConnectorFactory.register("PoolECConnector", "kvxfer.ec.pool", "PoolECConnector")
# The pool's name before it took its transport by name: configs that name it keep working.
ECConnectorFactory.register("MooncakeECConnector", "kvxfer.ec.pool", "PoolECConnector")
