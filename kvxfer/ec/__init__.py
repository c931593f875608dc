"""Encoder-cache connectors: encoder outputs from encoder instances to prefill instances."""

from kvxfer.ec.base import (
    ECConnectorBase,
    ECLoadError,
    ECLoadHandle,
    check_hash,
    item_key,
    tensor_bytes,
)
from kvxfer.ec.factory import ECConnectorFactory

__all__ = [
    "ECConnectorBase",
    "ECConnectorFactory",
    "ECLoadError",
    "ECLoadHandle",
    "check_hash",
    "item_key",
    "tensor_bytes",
]
