"""`SharedStorageECConnector`: one safetensors file per item hash under a shared directory.

Writes are atomic and durable: the file is written under a temporary name in the same
directory, flushed to disk (fsync), then renamed over the final name (and the directory is
fsynced), so readers see a whole file or none and concurrent writers of one hash leave one whole
file. Files are created with mode 0666 filtered by the process umask, like any other file the
process creates (so a group-shared directory works with `umask 002`).

Every file carries a SHA-256 over its tensor's dtype, shape and bytes: a file whose header was
edited (say 64x32 F32 into 32x64 I32, the same number of bytes), whose bytes changed, or that
was truncated is reported, never served. `has` is True only for a file whose size matches what
its own header declares, so a truncated file is never announced.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from kvxfer.ec.base import ECConnectorBase, ECLoadError, tensor_bytes

_KEY = "encoder_output"
_FORMAT = "kvxfer-ec/2"
_MAX_HEADER = 1 << 20  # one tensor's header is well under 1 KiB


def content_digest(tensor: torch.Tensor) -> str:
    """SHA-256 over a tensor's dtype, shape and bytes (what a stored file must reproduce)."""
    digest = hashlib.sha256()
    digest.update(_FORMAT.encode())
    digest.update(b"\0" + str(tensor.dtype).removeprefix("torch.").encode())
    digest.update(b"\0" + ",".join(str(int(n)) for n in tensor.shape).encode() + b"\0")
    digest.update(tensor_bytes(tensor).numpy().tobytes())
    return digest.hexdigest()


def declared_size(head: bytes) -> int | None:
    """The file size a safetensors file's first bytes (its length prefix and header) declare.

    Returns:
        8 + header length + the end of the tensor's data, or None when `head` holds no whole,
        valid header.
    """
    if len(head) < 8:
        return None
    (header_len,) = struct.unpack("<Q", head[:8])
    if header_len > _MAX_HEADER or len(head) < 8 + header_len:
        return None
    try:
        header = json.loads(head[8 : 8 + header_len])
        end = int(header[_KEY]["data_offsets"][1])
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    return 8 + header_len + end


class SharedStorageECConnector(ECConnectorBase):
    """Encoder outputs as files in `config["path"]` (created if missing).

    Config:
        path: the shared directory.
        delete_on_release: a consumer's `release` deletes the file (default False: other
            consumers may still need it).
        fsync: flush each file and the directory to disk before it is visible (default True;
            False trades crash safety for speed on a local scratch directory).
    """

    def __init__(self, role: str, config: dict[str, Any] | None = None) -> None:
        super().__init__(role, config)
        if "path" not in self.config:
            raise ValueError("config: SharedStorageECConnector needs 'path', a shared directory")
        self.path = Path(self.config["path"])
        self.path.mkdir(parents=True, exist_ok=True)
        self._fsync = bool(self.config.get("fsync", True))

    def file_of(self, mm_hash: str) -> Path:
        """Where an item's encoder output lives."""
        return self.path / f"{mm_hash}.safetensors"

    def _save(self, mm_hash: str, tensor: torch.Tensor) -> None:
        cpu = tensor.cpu().contiguous()
        data = save_safetensors(
            {_KEY: cpu}, metadata={"format": _FORMAT, "sha256": content_digest(cpu)}
        )
        tmp = self.path / f".{mm_hash}.{secrets.token_hex(8)}.tmp"
        # O_EXCL with mode 0666: the kernel applies the umask, as for any file the process makes
        # (tempfile.mkstemp would force 0600 and hide the file from a shared group).
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                if self._fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, self.file_of(mm_hash))
        finally:
            if tmp.exists():
                tmp.unlink()
        if self._fsync:
            self._sync_directory()

    def _sync_directory(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:  # some file systems do not open directories; the rename still happened
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    def _has(self, mm_hash: str) -> bool:
        path = self.file_of(mm_hash)
        try:
            with open(path, "rb") as f:  # one open file: a concurrent rename cannot mix two
                size = os.fstat(f.fileno()).st_size
                head = f.read(8)
                if len(head) == 8:
                    (header_len,) = struct.unpack("<Q", head)
                    head += f.read(min(header_len, _MAX_HEADER))
        except OSError:
            return False
        return declared_size(head) == size

    def _load(self, mm_hash: str) -> torch.Tensor:
        path = self.file_of(mm_hash)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise ECLoadError(f"no encoder output for {mm_hash!r} under {self.path}") from None
        except OSError as exc:
            raise ECLoadError(f"{path} is unreadable: {exc}") from exc
        expected = declared_size(data)
        if expected is None or expected != len(data):
            raise ECLoadError(
                f"{path} is unreadable (truncated or corrupt): {len(data)} bytes, its header "
                f"declares {expected}"
            )
        try:
            tensor = load_safetensors(data)[_KEY]
            metadata = _metadata(data)
        except Exception as exc:  # safetensors raises several types for a damaged file
            raise ECLoadError(f"{path} is unreadable (truncated or corrupt): {exc}") from exc
        if metadata.get("format") != _FORMAT or "sha256" not in metadata:
            raise ECLoadError(
                f"{path} is corrupt or from another kvxfer version: no {_FORMAT} checksum "
                "(save the item again)"
            )
        if content_digest(tensor) != metadata["sha256"]:
            raise ECLoadError(
                f"{path} is corrupt: its dtype, shape or bytes do not match the stored checksum"
            )
        return tensor

    def _release(self, mm_hash: str) -> None:
        if self.config.get("delete_on_release", False):
            self.file_of(mm_hash).unlink(missing_ok=True)


def _metadata(data: bytes) -> dict[str, str]:
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise ValueError("__metadata__ is not an object")
    return {str(k): str(v) for k, v in metadata.items()}
