"""Head ownership over TP ranks, and which source rank feeds each destination head and layer."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvxfer.spec import KVCacheSpec


def heads_of_rank(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """Global KV heads held by `rank` (docs/design.md, head ownership).

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
    """A contiguous run of global heads, over a contiguous run of global layers, that one
    source rank sends to one destination rank.

    Ranks are engine ranks (`KVCacheSpec.engine_rank`: `pp_rank * tp_size + tp_rank`, the TP
    rank without pipeline parallelism). A route moves only its layers: on each side the local
    layer of global layer `l` is `l - spec.layer_start` (`layer_span`), and staging holds
    the route's layers alone, back to back from `layer_start`.
    """

    src_rank: int
    dst_rank: int
    head_start: int  # first global head
    num_heads: int
    src_head_offset: int  # index of head_start among the source rank's heads
    dst_head_offset: int  # index of head_start among the destination rank's heads
    layer_start: int = 0  # first global layer
    # Global layers moved; None: every layer, both sides holding all of them (no pipeline
    # parallelism: what `route_heads` gives, which knows TP sizes only).
    num_layers: int | None = None

    def between(self, src_rank: int, dst_rank: int, layer_start: int, layer_stop: int) -> HeadRoute:
        """These heads, from engine rank `src_rank` to `dst_rank`, over global layers
        `[layer_start, layer_stop)`."""
        return replace(
            self,
            src_rank=src_rank,
            dst_rank=dst_rank,
            layer_start=layer_start,
            num_layers=layer_stop - layer_start,
        )

    def global_layers(self, src_spec: KVCacheSpec) -> range:
        """The global layers the route moves (a route without `num_layers`: all of the
        source's, which then holds every layer)."""
        if self.num_layers is None:
            return range(src_spec.layer_start, src_spec.layer_start + src_spec.num_layers)
        return range(self.layer_start, self.layer_start + self.num_layers)

    def narrowed(self, layer_start: int, layer_stop: int) -> HeadRoute:
        """These heads between the same ranks over global layers `[layer_start, layer_stop)`
        only (one chunk of a streamed fetch: `FittedPair.cuts`)."""
        return self.between(self.src_rank, self.dst_rank, layer_start, layer_stop)

    def layer_span(self, src_spec: KVCacheSpec, dst_spec: KVCacheSpec) -> tuple[int, int, int]:
        """(layers moved, local index of the first on the source, on the destination).

        Raises:
            ValueError: the route's layers are not all held by both ranks (a route without
                `num_layers` pairs ranks that hold every layer only).
        """
        if self.num_layers is None:
            if (
                src_spec.layer_start
                or dst_spec.layer_start
                or src_spec.num_layers != dst_spec.num_layers
            ):
                raise ValueError(
                    "route: a route without layers (route_heads) pairs ranks holding every "
                    "layer; with pipeline parallelism, plan with plan_pairs or route_pair"
                )
            return src_spec.num_layers, 0, 0
        n = self.num_layers
        src_first = self.layer_start - src_spec.layer_start
        dst_first = self.layer_start - dst_spec.layer_start
        if not (
            n >= 1
            and 0 <= src_first <= src_spec.num_layers - n
            and 0 <= dst_first <= dst_spec.num_layers - n
        ):
            s, d = src_spec.layers, dst_spec.layers
            raise ValueError(
                f"route: layers [{self.layer_start}, {self.layer_start + n}) are not all held by "
                f"the source (layers [{s.start}, {s.stop})) and the destination ([{d.start}, "
                f"{d.stop})); plan with plan_pairs or route_pair"
            )
        return n, src_first, dst_first


def route_heads(num_kv_heads: int, src_tp: int, dst_tp: int) -> list[HeadRoute]:
    """For every destination rank, the source rank that supplies each of its heads.

    When several source ranks hold a head (source-side replication, or an MLA latent, which
    every rank holds), destination rank `d` reads from replica `d % replicas`, which spreads the
    destinations evenly over the replicas. Consecutive heads from the same source rank form one
    route. Routes are sorted by (dst_rank, head_start). Layers are not routed here (TP ranks
    only, every layer: `num_layers` is None); `route_pair` and `plan_pairs` route layers too.

    Args:
        num_kv_heads: global KV heads (1 for MLA).
        src_tp: source TP size.
        dst_tp: destination TP size.
    """
    routes: list[HeadRoute] = []
    for dst_rank in range(dst_tp):
        routes.extend(_routes_to(num_kv_heads, src_tp, dst_tp, dst_rank, dst_rank))
    return routes


def _routes_to(
    num_kv_heads: int, src_tp: int, dst_tp: int, dst_rank: int, replica: int
) -> list[HeadRoute]:
    """The head routes into TP rank `dst_rank` of the destination, reading replica
    `replica % replicas` of replicated source heads (one route per source TP rank)."""
    routes: list[HeadRoute] = []
    dst_heads = heads_of_rank(num_kv_heads, dst_tp, dst_rank)
    for head in dst_heads:
        # An MLA latent is head 0 of 1, so every source rank is one of its replicas.
        holders = ranks_holding_head(num_kv_heads, src_tp, head)
        src_rank = holders[replica % len(holders)]
        src_offset = head - heads_of_rank(num_kv_heads, src_tp, src_rank).start
        last = routes[-1] if routes else None
        if (
            last is not None
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


def routes_into(src_layers: list[range], src_tp: int, dst: KVCacheSpec) -> list[HeadRoute]:
    """Every route into destination rank `dst`, from a source engine of TP `src_tp` whose
    pipeline stage `p` holds global layers `src_layers[p]`.

    For each of `dst`'s heads, the source TP rank as `route_heads` picks it, with replicas
    chosen by `dst.engine_rank` (its TP rank without pipeline parallelism; with it, the stages
    of the destination spread over the replicas too); for each source stage whose layers meet
    `dst`'s, one route over the shared layers. Sorted by (head_start, layer_start).
    """
    dst_layers = dst.layers
    routes = []
    for route in _routes_to(dst.num_kv_heads, src_tp, dst.tp_size, dst.tp_rank, dst.engine_rank):
        for stage, layers in enumerate(src_layers):
            start, stop = max(layers.start, dst_layers.start), min(layers.stop, dst_layers.stop)
            if start < stop:
                routes.append(
                    route.between(stage * src_tp + route.src_rank, dst.engine_rank, start, stop)
                )
    return routes


def route_pair(src: KVCacheSpec, dst: KVCacheSpec) -> HeadRoute | None:
    """The route from source rank `src` to destination rank `dst` (the one `plan_pairs` plans
    for that pair), from the two specs alone, or None when the pair moves nothing. What a
    producer computes for a consumer at handshake."""
    start = max(src.layer_start, dst.layer_start)
    stop = min(src.layer_start + src.num_layers, dst.layer_start + dst.num_layers)
    if start >= stop:
        return None
    heads = _routes_to(dst.num_kv_heads, src.tp_size, dst.tp_size, dst.tp_rank, dst.engine_rank)
    for route in heads:
        if route.src_rank == src.tp_rank:
            return route.between(src.engine_rank, dst.engine_rank, start, stop)
    return None
