"""`KVCacheSpec`: the geometry of one rank's paged KV cache, and the handshake's payload.

The layout contract (DESIGN.md) fixes the per-layer tensor shape for every combination of
`layout`, `kv_placement` and `mla`; `kvxfer.layout` is its single source of truth, and
`KVCacheSpec.layer_shape` reads it from there.
"""

from __future__ import annotations

from typing import Literal, NoReturn

import msgspec
import numpy as np
import torch

from kvxfer.layout import KV_PLACEMENTS, LAYOUTS, KVPlacement, Layout
from kvxfer.layout import layer_shape as _layer_shape

# fp8 caches (vLLM's kv_cache_dtype "fp8", "fp8_e4m3", "fp8_e5m2") are moved as bytes: every
# path copies bits, none does fp8 arithmetic.
DType = Literal["float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"]

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
DTYPE_ITEMSIZE: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


INT_FIELDS: tuple[str, ...] = (
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "tp_size",
    "tp_rank",
    "block_size",
    "num_blocks",
)


def _fail(field: str, problem: str, fix: str) -> NoReturn:
    raise ValueError(f"KVCacheSpec.{field}: {problem}; {fix}")


def _as_int(field: str, value: object) -> int:
    """`value` as a plain int: Python and numpy integers pass, bools and all else are refused."""
    if isinstance(value, (bool, np.bool_)):
        _fail(
            field,
            f"must be an integer, got the bool {value!r}",
            "pass an int such as 1 (numpy integers are accepted too), not True/False",
        )
    if isinstance(value, (int, np.integer)):
        return int(value)
    _fail(
        field,
        f"must be an integer, got {value!r} of type {type(value).__name__}",
        "pass an int (numpy integers are accepted too)",
    )


def _normalize(spec: KVCacheSpec, field: str, value: object) -> None:
    """Store a plain `int`/`bool` in place of a numpy scalar, so specs encode and compare alike."""
    given = getattr(spec, field)
    if type(given) is type(value):
        return
    force_setattr = getattr(msgspec.structs, "force_setattr", None)
    if force_setattr is None:  # msgspec < 0.18.5 cannot set a field of a frozen struct
        _fail(
            field,
            f"got a {type(given).__name__}, which this msgspec version cannot convert",
            f"pass {field}=int(...) or install msgspec>=0.18.5",
        )
    force_setattr(spec, field, value)


class KVCacheSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's KV cache geometry: what the rank holds and how it lays it out in memory.

    Attributes:
        num_layers: attention layers, one cache tensor each.
        num_kv_heads: KV heads of the whole model (`H`), not of this rank. 1 when `mla`.
        head_dim: elements per head (the MLA latent width when `mla`).
        dtype: "float16", "bfloat16", "float32", or an fp8 cache: "float8_e4m3fn" or
            "float8_e5m2" (moved bit for bit like the others).
        tp_size: tensor-parallel size of this engine (`T`).
        tp_rank: this rank, in `[0, tp_size)`.
        block_size: tokens per block (page).
        num_blocks: blocks per layer tensor.
        layout: "NHD" (tokens, heads) or "HND" (heads, tokens) inside a block.
        kv_placement: "kv_first" (`[2, blocks, ...]`), "blocks_first" (`[blocks, 2, ...]`) or
            "kv_inner" (K then V in each head's row: `[blocks, ..., 2 * head_dim]`, vLLM 0.33).
        mla: one latent plane `[num_blocks, block_size, head_dim]`, the same on every rank;
            `layout` and `kv_placement` are then ignored.

    Head ownership (DESIGN.md): with `H >= T`, `T` divides `H` and rank `r` holds heads
    `[r*H/T, (r+1)*H/T)`; with `H < T`, `H` divides `T` and rank `r` holds head `r // (T/H)`.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: DType
    tp_size: int
    tp_rank: int
    block_size: int
    num_blocks: int
    layout: Layout = "NHD"
    kv_placement: KVPlacement = "kv_first"
    mla: bool = False

    def __post_init__(self) -> None:
        for name in INT_FIELDS:
            _normalize(self, name, _as_int(name, getattr(self, name)))
        if isinstance(self.mla, np.bool_):
            _normalize(self, "mla", bool(self.mla))
        for name in ("num_layers", "num_kv_heads", "head_dim", "tp_size", "block_size"):
            value = getattr(self, name)
            if value <= 0:
                _fail(name, f"must be a positive integer, got {value!r}", "pass a value >= 1")
        if self.num_blocks <= 0:
            _fail("num_blocks", f"must be positive, got {self.num_blocks}", "pass >= 1")
        if not 0 <= self.tp_rank < self.tp_size:
            _fail(
                "tp_rank",
                f"{self.tp_rank!r} is out of range for tp_size {self.tp_size}",
                f"pass a rank in [0, {self.tp_size})",
            )
        if self.dtype not in TORCH_DTYPES:
            _fail("dtype", f"unknown dtype {self.dtype!r}", f"use one of {sorted(TORCH_DTYPES)}")
        if self.layout not in LAYOUTS:
            _fail("layout", f"unknown layout {self.layout!r}", f"use one of {list(LAYOUTS)}")
        if self.kv_placement not in KV_PLACEMENTS:
            _fail(
                "kv_placement",
                f"unknown placement {self.kv_placement!r}",
                f"use one of {list(KV_PLACEMENTS)}",
            )
        if not isinstance(self.mla, bool):
            _fail("mla", f"must be a bool, got {self.mla!r}", "pass True or False")
        if self.mla and self.num_kv_heads != 1:
            _fail(
                "num_kv_heads",
                f"an MLA cache has one latent head, got {self.num_kv_heads}",
                "pass num_kv_heads=1 with mla=True",
            )
        heads, tp = self.num_kv_heads, self.tp_size
        if heads >= tp and heads % tp != 0:
            _fail(
                "num_kv_heads",
                f"{heads} KV heads cannot be split evenly over tp_size {tp}",
                "use a tp_size that divides num_kv_heads",
            )
        if heads < tp and tp % heads != 0:
            _fail(
                "num_kv_heads",
                f"{heads} KV heads cannot be replicated evenly over tp_size {tp}",
                "use a tp_size that is a multiple of num_kv_heads",
            )

    @property
    def heads_per_rank(self) -> int:
        """KV heads held by one rank (`h`)."""
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def first_head(self) -> int:
        """Global index of this rank's first KV head."""
        if self.num_kv_heads >= self.tp_size:
            return self.tp_rank * self.heads_per_rank
        return self.tp_rank // (self.tp_size // self.num_kv_heads)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of the cache tensors."""
        return TORCH_DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """The per-layer tensor shape of the layout contract (`kvxfer.layout`)."""
        return _layer_shape(
            self.num_blocks,
            self.block_size,
            self.heads_per_rank,
            self.head_dim,
            self.layout,
            self.kv_placement,
            self.mla,
        )

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer tensor."""
        n = self.itemsize
        for dim in self.layer_shape:
            n *= dim
        return n

    def with_rank(self, tp_rank: int) -> KVCacheSpec:
        """The same geometry as seen by another rank of the same engine."""
        return msgspec.structs.replace(self, tp_rank=tp_rank)

    def engine_ranks(self) -> list[KVCacheSpec]:
        """The specs of every rank of this engine, in rank order (what `plan_pairs` takes)."""
        return [self.with_rank(rank) for rank in range(self.tp_size)]


def encode_spec(spec: KVCacheSpec) -> bytes:
    """Serialize a spec with msgpack (the handshake's wire format)."""
    return msgspec.msgpack.encode(spec)


def decode_spec(data: bytes) -> KVCacheSpec:
    """Parse and validate a spec from msgpack; a bad field raises `msgspec.ValidationError`."""
    return msgspec.msgpack.decode(data, type=KVCacheSpec)


def allocate_kv_caches(spec: KVCacheSpec, device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """Allocate one uninitialized tensor per layer, shaped by the layout contract.

    Args:
        spec: the rank's geometry.
        device: where to allocate.

    Returns:
        `spec.num_layers` contiguous tensors of shape `spec.layer_shape` and dtype `spec.dtype`.
    """
    return [
        torch.empty(spec.layer_shape, dtype=spec.torch_dtype, device=device)
        for _ in range(spec.num_layers)
    ]
