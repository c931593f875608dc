"""Encoder outputs shared by the encoder-cache tests, reproducible in every process."""

from __future__ import annotations

import hashlib

import torch

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SHAPES = [(1, 7), (16, 64), (3, 5, 8), (577, 32)]


def items() -> dict[str, torch.Tensor]:
    """Tensors of every dtype and shape, keyed by the hash of their content."""
    out = {}
    for i, dtype in enumerate(DTYPES):
        for j, shape in enumerate(SHAPES):
            gen = torch.Generator().manual_seed(100 * i + j)
            tensor = torch.randn(shape, generator=gen).to(dtype)
            digest = hashlib.sha256(tensor.view(torch.uint8).numpy().tobytes()).hexdigest()
            out[digest[:32]] = tensor
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def producer_process(name: str, config: dict, conn) -> None:
    """Save every item with connector `name`, report its address, serve until told to stop."""
    from kvxfer.ec import ECConnectorFactory

    connector = ECConnectorFactory.create(name, "producer", config)
    for mm_hash, tensor in items().items():
        connector.save(mm_hash, tensor)
    conn.send(getattr(connector, "address", None))
    assert conn.recv() == "stop"
    connector.close()
    conn.send("closed")
