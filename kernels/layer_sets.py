"""How the cell-copy kernel reaches one side's layers: a device table of the layers' byte
addresses (a cache's separate layer tensors, built and validated once per set of tensors and
cached) or one stacked buffer (staging), with the alignment every address shares and the
pointer argument typed to the word the kernel moves."""

from __future__ import annotations

import functools
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from kvxfer.kernels.buffers import KVBuffer, StackedLayers, check_layers

VECTOR_BYTES = 16  # the widest access a GPU thread issues (ld.global.v4.b32)


@dataclass(frozen=True)
class LayerSet:
    """One side's layers as the kernel reaches them, validated once."""

    word_view: torch.Tensor  # layer 0 (table mode) or the flat staging, as words
    table: torch.Tensor | None  # [layers] int64 byte addresses on the device, or None (stacked)
    layer_stride_bytes: int  # stacked mode
    alignment: int  # the largest power of two (up to 16) dividing every layer's address


# Tables of layer addresses, per set of layer tensors: a serving engine has a few (its caches),
# so they are built once and reused by every launch. Keyed by the addresses themselves.
_TABLES: OrderedDict[tuple[Any, ...], tuple[torch.Tensor, int]] = OrderedDict()
_TABLES_MAX = 64
_TABLES_LOCK = threading.Lock()


def alignment(value: int) -> int:
    """The largest power of two up to 16 that divides `value`."""
    return math.gcd(value, VECTOR_BYTES) if value else VECTOR_BYTES


def layer_table(name: str, buf: KVBuffer) -> tuple[torch.Tensor, int]:
    """The device tensor of `buf`'s layer addresses and their common alignment (the largest
    power of two up to 16 dividing all), built (and the layers validated) once per set of
    layer tensors and cached; a staging buffer (`StackedLayers`) needs none.

    Raises:
        ValueError: layers of different shapes, dtypes or devices.
    """
    addresses = tuple(map(torch.Tensor.data_ptr, buf.layers))
    first = buf.layers[0]
    key = (first.device, first.dtype, first.shape, first.stride(), addresses)
    with _TABLES_LOCK:
        entry = _TABLES.get(key)
        if entry is not None:
            _TABLES.move_to_end(key)
            return entry
    check_layers(name, buf)
    host = torch.tensor(addresses, dtype=torch.int64)
    if first.device.type == "cuda":  # once per cache set; asynchronous all the same
        table = host.pin_memory().to(first.device, non_blocking=True)
    else:
        table = host
    entry = (table, functools.reduce(math.gcd, addresses, VECTOR_BYTES))
    with _TABLES_LOCK:
        _TABLES[key] = entry
        while len(_TABLES) > _TABLES_MAX:
            _TABLES.popitem(last=False)
    return entry


_TYPE_TOKENS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _type_token(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor that only gives a pointer argument its element type (table mode)."""
    token = _TYPE_TOKENS.get((device, dtype))
    if token is None:
        token = _TYPE_TOKENS.setdefault((device, dtype), torch.empty(0, dtype=dtype, device=device))
    return token


def layer_set(name: str, buf: KVBuffer) -> LayerSet:
    layers = buf.layers
    if isinstance(layers, StackedLayers):
        used = layers.flat[: layers.num_layers * layers.layer_elements]
        layer_bytes = layers.layer_elements * used.element_size()
        return LayerSet(used.view(torch.uint8), None, layer_bytes, alignment(used.data_ptr()))
    table, align = layer_table(name, buf)
    return LayerSet(_type_token(layers[0].device, torch.uint8), table, 0, align)


def with_words(layer_set: LayerSet, word: torch.dtype) -> LayerSet:
    """The same layers, with the pointer argument retyped to `word`."""
    view = layer_set.word_view
    retyped = view.view(word) if layer_set.table is None else _type_token(view.device, word)
    return LayerSet(retyped, layer_set.table, layer_set.layer_stride_bytes, layer_set.alignment)
