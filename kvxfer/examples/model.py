"""A small transformer whose attention reads and writes a paged KV cache in the layout contract.

GQA (K/V heads shared by groups of query heads) or MLA (one latent plane, from which every
query head's K and V are projected). Weights come from a seed. Tensor parallelism splits the KV
heads as docs/design.md's head ownership says, and the query heads evenly; every other weight is
replicated.

Sharded ranks reproduce the unsharded model bit for bit: every rank runs the same full-width
matmuls as the reference and keeps its heads, attention runs one head at a time with the same
shapes, and the ranks exchange per-head outputs (an all-gather) instead of summing partial
projections, so no sum is ever reordered. That is what lets the demo demand an exact match.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvxfer.kernels import canonical_kv_view
from kvxfer.kernels.convert import convert_torch
from kvxfer.spec import FP8_DTYPES, KVCacheSpec

AllGather = Callable[[torch.Tensor], torch.Tensor]  # [tokens, local width] -> [tokens, width]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the model. `kv_heads` must let the TP sizes in use split or replicate it."""

    vocab: int = 512
    hidden: int = 256
    layers: int = 4
    q_heads: int = 48
    kv_heads: int = 24
    head_dim: int = 16
    mla: bool = False
    latent_dim: int = 32
    max_positions: int = 2048
    seed: int = 0

    @property
    def cache_heads(self) -> int:
        """KV heads in the cache (1 latent for MLA)."""
        return 1 if self.mla else self.kv_heads

    @property
    def cache_head_dim(self) -> int:
        """Elements per cached head (the latent width for MLA)."""
        return self.latent_dim if self.mla else self.head_dim


def init_weights(config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every weight, from the seed (each rank builds all of them and uses its slices)."""
    gen = torch.Generator().manual_seed(config.seed)

    def rand(*shape: int, fan_in: int | None = None) -> torch.Tensor:
        scale = 1.0 / math.sqrt(fan_in or shape[0])
        return torch.randn(*shape, generator=gen) * scale

    c, d = config, config.hidden
    w = {
        "embed": rand(c.vocab, d, fan_in=1) * 0.5,
        "pos": rand(c.max_positions, d, fan_in=1) * 0.1,
        "unembed": rand(d, c.vocab),
    }
    for i in range(c.layers):
        w[f"{i}.wq"] = rand(d, c.q_heads * c.head_dim)
        if c.mla:
            w[f"{i}.wdkv"] = rand(d, c.latent_dim)
            w[f"{i}.wuk"] = rand(c.latent_dim, c.q_heads * c.head_dim)
            w[f"{i}.wuv"] = rand(c.latent_dim, c.q_heads * c.head_dim)
        else:
            w[f"{i}.wk"] = rand(d, c.kv_heads * c.head_dim)
            w[f"{i}.wv"] = rand(d, c.kv_heads * c.head_dim)
        w[f"{i}.wo"] = rand(c.q_heads * c.head_dim, d)
        w[f"{i}.w1"] = rand(d, 2 * d)
        w[f"{i}.w2"] = rand(2 * d, d)
    return w


def _norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_from: int) -> torch.Tensor:
    """One head: q [n, hd], k and v [t, hd]; query i sees keys [0, causal_from + i]."""
    scores = (q @ k.T) / math.sqrt(q.shape[-1])
    n, t = scores.shape
    allowed = torch.arange(t)[None, :] <= (causal_from + torch.arange(n))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


class ShardedModel:
    """One TP rank of the model, over its paged KV cache.

    Args:
        config: the model.
        weights: `init_weights(config)`.
        spec: this rank's cache geometry (its `tp_size` and `tp_rank` shard the heads).
        caches: this rank's layer tensors.
        all_gather: joins the ranks' per-head outputs in rank order (identity for TP 1).
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        spec: KVCacheSpec,
        caches: list[torch.Tensor],
        all_gather: AllGather | None = None,
    ) -> None:
        if config.q_heads % spec.tp_size:
            raise ValueError(f"q_heads {config.q_heads} do not split over TP {spec.tp_size}")
        self.c, self.w, self.spec, self.caches = config, weights, spec, caches
        self.all_gather = all_gather or (lambda x: x)
        per_rank = config.q_heads // spec.tp_size
        self.q_heads = range(spec.tp_rank * per_rank, (spec.tp_rank + 1) * per_rank)
        self.group = config.q_heads // config.kv_heads  # query heads per KV head (GQA)

    def _views(self, layer: int) -> torch.Tensor:
        """A layer's cache as `[planes, blocks, slots, heads, dim]` integers of its element
        width (CPU torch indexes no fp8: the cells move as their bits)."""
        s = self.spec
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[s.itemsize]
        view = canonical_kv_view(self.caches[layer], s.layout, s.kv_placement, s.mla)
        return view.view(bits)

    def _scales(self, layer: int) -> torch.Tensor | None:
        """The layer's (K, V) scales, shaped to scale `[planes, tokens, heads, dim]` cells, for
        an fp8 cache (vLLM's k_scale and v_scale: it stores `K / k_scale`); else None."""
        if self.spec.dtype not in FP8_DTYPES:
            return None
        return torch.from_numpy(self.spec.layer_scales(layer, 1)[0])[:, None, None, None]

    def _write_kv(
        self, layer: int, cells: torch.Tensor, block_ids: torch.Tensor, start: int
    ) -> None:
        """Store new tokens' K/V (or latent) at positions `start...` in the paged cache (in
        the cache's dtype: an fp8 cache holds them quantized as vLLM's cache write does)."""
        positions = torch.arange(start, start + cells.shape[-3])
        blocks = block_ids[positions // self.spec.block_size]
        slots = positions % self.spec.block_size
        stored = convert_torch(cells, self.spec.torch_dtype, self._scales(layer))
        view = self._views(layer)  # [planes, blocks, slots, heads, dim]
        for plane in range(view.shape[0]):
            view[plane, blocks, slots] = stored[plane].view(view.dtype)

    def _read_kv(self, layer: int, block_ids: torch.Tensor, length: int) -> torch.Tensor:
        """Cached K/V (or latent) of positions [0, length) as float32 (an fp8 cache's
        dequantized with its scales): [planes, length, heads, dim]."""
        positions = torch.arange(length)
        blocks = block_ids[positions // self.spec.block_size]
        cells = self._views(layer)[:, blocks, positions % self.spec.block_size]
        stored = cells.view(self.spec.torch_dtype)
        return convert_torch(stored, torch.float32, self._scales(layer))

    def forward(self, tokens: torch.Tensor, start: int, block_ids: torch.Tensor) -> torch.Tensor:
        """Run `tokens` at positions `start...` (prefill: start 0; decode: one token), writing
        their KV into the cache; return the logits of every position."""
        c, w = self.c, self.w
        x = w["embed"][tokens] + w["pos"][start : start + len(tokens)]
        hd = c.head_dim
        for i in range(c.layers):
            h = _norm(x)
            q = (h @ w[f"{i}.wq"]).view(len(tokens), c.q_heads, hd)
            if c.mla:
                latent = (h @ w[f"{i}.wdkv"])[None, :, None, :]  # [1, tokens, 1, latent]
                self._write_kv(i, latent, block_ids, start)
            else:
                k = (h @ w[f"{i}.wk"]).view(len(tokens), c.kv_heads, hd)
                v = (h @ w[f"{i}.wv"]).view(len(tokens), c.kv_heads, hd)
                mine = slice(self.spec.first_head, self.spec.first_head + self.spec.heads_per_rank)
                self._write_kv(i, torch.stack([k[:, mine], v[:, mine]]), block_ids, start)
            cached = self._read_kv(i, block_ids, start + len(tokens))
            outs = [self._head(i, j, q[:, j], cached, start) for j in self.q_heads]
            heads = self.all_gather(torch.cat(outs, dim=-1))  # [tokens, q_heads * hd]
            x = x + heads @ w[f"{i}.wo"]
            x = x + torch.relu(_norm(x) @ w[f"{i}.w1"]) @ w[f"{i}.w2"]
        return _norm(x) @ w["unembed"]

    def _head(
        self, layer: int, q_head: int, q: torch.Tensor, cached: torch.Tensor, start: int
    ) -> torch.Tensor:
        """Attention of one query head over the cached tokens."""
        c, w, hd = self.c, self.w, self.c.head_dim
        if c.mla:
            latent = cached[0, :, 0]  # [length, latent]
            cols = slice(q_head * hd, (q_head + 1) * hd)
            k, v = latent @ w[f"{layer}.wuk"][:, cols], latent @ w[f"{layer}.wuv"][:, cols]
        else:
            local = q_head // self.group - self.spec.first_head
            k, v = cached[0, :, local], cached[1, :, local]
        return _attend(q, k, v, start)
