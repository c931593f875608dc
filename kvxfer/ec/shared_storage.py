"""`SharedStorageECConnector`: one safetensors file per item hash under a shared directory.

Writes are atomic (a temporary file in the same directory, then a rename), so readers see a
whole file or none and concurrent writers of one hash leave one whole file. Every file carries
the SHA-256 of its tensor's bytes: a truncated or corrupt file is reported, never served.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvxfer.ec.base import ECConnectorBase, ECLoadError

_KEY = "encoder_output"


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class SharedStorageECConnector(ECConnectorBase):
    """Encoder outputs as files in `config["path"]` (created if missing).

    Config:
        path: the shared directory.
        delete_on_release: a consumer's `release` deletes the file (default False: other
            consumers may still need it).
    """

    def __init__(self, role: str, config: dict[str, Any] | None = None) -> None:
        super().__init__(role, config)
        if "path" not in self.config:
            raise ValueError("config: SharedStorageECConnector needs 'path', a shared directory")
        self.path = Path(self.config["path"])
        self.path.mkdir(parents=True, exist_ok=True)

    def file_of(self, mm_hash: str) -> Path:
        """Where an item's encoder output lives."""
        return self.path / f"{mm_hash}.safetensors"

    def _save(self, mm_hash: str, tensor: torch.Tensor) -> None:
        cpu = tensor.cpu()
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=f".{mm_hash}.", suffix=".tmp")
        os.close(fd)
        try:
            save_file({_KEY: cpu}, tmp, metadata={"sha256": _digest(cpu)})
            os.replace(tmp, self.file_of(mm_hash))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _has(self, mm_hash: str) -> bool:
        return self.file_of(mm_hash).is_file()

    def _load(self, mm_hash: str) -> torch.Tensor:
        path = self.file_of(mm_hash)
        if not path.is_file():
            raise ECLoadError(f"no encoder output for {mm_hash!r} under {self.path}")
        try:
            with safe_open(path, framework="pt") as f:
                expected = (f.metadata() or {}).get("sha256")
                tensor = f.get_tensor(_KEY)
        except ECLoadError:
            raise
        except Exception as exc:  # safetensors raises several types for a damaged file
            raise ECLoadError(f"{path} is unreadable (truncated or corrupt): {exc}") from exc
        if expected is None or _digest(tensor) != expected:
            raise ECLoadError(f"{path} is corrupt: its bytes do not match the stored checksum")
        return tensor

    def _release(self, mm_hash: str) -> None:
        if self.config.get("delete_on_release", False):
            self.file_of(mm_hash).unlink(missing_ok=True)
