"""Head ownership over TP ranks, and which source rank feeds each destination head."""

from __future__ import annotations

from dataclasses import dataclass


def heads_of_rank(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """Global KV heads held by `rank` (DESIGN.md, head ownership).

    Split when `num_kv_heads >= tp_size`, one replicated head per rank otherwise.
    """
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is out of range for tp_size {tp_size}")
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads do not split evenly over TP {tp_size}")
        per_rank = num_kv_heads // tp_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    if tp_size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads do not replicate evenly over TP {tp_size}")
    head = rank // (tp_size // num_kv_heads)
    return range(head, head + 1)


def ranks_holding_head(num_kv_heads: int, tp_size: int, head: int) -> range:
    """Every rank that holds global `head` (more than one when heads are replicated)."""
    if num_kv_heads >= tp_size:
        per_rank = num_kv_heads // tp_size
        return range(head // per_rank, head // per_rank + 1)
    replicas = tp_size // num_kv_heads
    return range(head * replicas, (head + 1) * replicas)


@dataclass(frozen=True)
class HeadRoute:
    """A contiguous run of global heads that one source rank sends to one destination rank."""

    src_rank: int
    dst_rank: int
    head_start: int  # first global head
    num_heads: int
    src_head_offset: int  # index of head_start among the source rank's heads
    dst_head_offset: int  # index of head_start among the destination rank's heads


def route_heads(num_kv_heads: int, src_tp: int, dst_tp: int) -> list[HeadRoute]:
    """For every destination rank, the source rank that supplies each of its heads.

    When several source ranks hold a head (source-side replication, or an MLA latent, which
    every rank holds), destination rank `d` reads from replica `d % replicas`, which spreads the
    destinations evenly over the replicas. Consecutive heads from the same source rank form one
    route. Routes are sorted by (dst_rank, head_start).

    Args:
        num_kv_heads: global KV heads (1 for MLA).
        src_tp: source TP size.
        dst_tp: destination TP size.
    """
    routes: list[HeadRoute] = []
    for dst_rank in range(dst_tp):
        dst_heads = heads_of_rank(num_kv_heads, dst_tp, dst_rank)
        for head in dst_heads:
            # An MLA latent is head 0 of 1, so every source rank is one of its replicas.
            holders = ranks_holding_head(num_kv_heads, src_tp, head)
            src_rank = holders[dst_rank % len(holders)]
            src_offset = head - heads_of_rank(num_kv_heads, src_tp, src_rank).start
            last = routes[-1] if routes else None
            if (
                last is not None
                and last.dst_rank == dst_rank
                and last.src_rank == src_rank
                and last.head_start + last.num_heads == head
            ):
                routes[-1] = HeadRoute(
                    src_rank,
                    dst_rank,
                    last.head_start,
                    last.num_heads + 1,
                    last.src_head_offset,
                    last.dst_head_offset,
                )
            else:
                routes.append(
                    HeadRoute(src_rank, dst_rank, head, 1, src_offset, head - dst_heads.start)
                )
    return routes
