"""The `kvxfer` command line: `kvxfer plan`, `kvxfer demo` and `kvxfer bench`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvxfer.bench import add_arguments as add_bench_arguments
from kvxfer.examples.pd_demo import add_arguments as add_demo_arguments
from kvxfer.plan import STRATEGIES, CostModel, PairPlan, plan_pairs
from kvxfer.plan.cost import reference_block_ids
from kvxfer.spec import KV_PLACEMENTS, KVCacheSpec

_SIDES = ("prefill", "decode")


def _add_plan_arguments(p: argparse.ArgumentParser) -> None:
    model = p.add_argument_group("model")
    model.add_argument("--num-layers", type=int, default=32)
    model.add_argument("--kv-heads", type=int, default=8, help="global KV heads (1 with --mla)")
    model.add_argument("--head-dim", type=int, default=128)
    model.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="bfloat16")
    model.add_argument("--mla", action="store_true", help="an MLA latent cache")
    defaults = {"prefill": (2, 16), "decode": (4, 16)}
    for side in _SIDES:
        group = p.add_argument_group(side)
        tp, bs = defaults[side]
        group.add_argument(f"--{side}-tp", type=int, default=tp)
        group.add_argument(f"--{side}-block-size", type=int, default=bs)
        group.add_argument(f"--{side}-layout", choices=["NHD", "HND"], default="NHD")
        group.add_argument(f"--{side}-placement", choices=list(KV_PLACEMENTS), default="kv_first")
    req = p.add_argument_group("request and cost model")
    req.add_argument("--tokens", type=int, default=4096, help="tokens in the request")
    req.add_argument("--strategy", choices=STRATEGIES, help="force one strategy for every pair")
    req.add_argument(
        "--contiguous-blocks",
        action="store_true",
        help="assume consecutive block ids (default: scattered, no two adjacent)",
    )
    req.add_argument(
        "--link",
        choices=["rdma", "tcp"],
        default="rdma",
        help="cost-model constants: 400 Gbps RDMA (default) or TCP on loopback",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _side_specs(args: argparse.Namespace, side: str) -> list[KVCacheSpec]:
    tp = getattr(args, f"{side}_tp")
    block_size = getattr(args, f"{side}_block_size")
    needed = len(reference_block_ids(args.tokens, block_size, args.contiguous_blocks))
    return KVCacheSpec(
        num_layers=args.num_layers,
        num_kv_heads=1 if args.mla else args.kv_heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        tp_size=tp,
        tp_rank=0,
        block_size=block_size,
        num_blocks=2 * needed + 1,
        layout=getattr(args, f"{side}_layout"),
        kv_placement=getattr(args, f"{side}_placement"),
        mla=args.mla,
    ).engine_ranks()


def plan_report(args: argparse.Namespace) -> dict[str, Any]:
    """Plan a request between the two sides described by `args`, as a JSON-ready dict."""
    if args.tokens <= 0:
        raise ValueError(f"--tokens: must be positive, got {args.tokens}")
    src, dst = _side_specs(args, "prefill"), _side_specs(args, "decode")
    base = CostModel() if args.link == "rdma" else CostModel.tcp_loopback()
    model = replace(base, contiguous_blocks=args.contiguous_blocks)
    plans = plan_pairs(
        src, dst, cost_model=model, strategy=args.strategy, reference_tokens=args.tokens
    )
    per_source: dict[int, float] = {}
    for plan in plans:
        per_source[plan.src_rank] = per_source.get(plan.src_rank, 0.0) + plan.chosen.seconds
    return {
        "tokens": args.tokens,
        "block_allocation": "contiguous" if args.contiguous_blocks else "scattered",
        "link": args.link,
        "prefill": _side_summary(src[0]),
        "decode": _side_summary(dst[0]),
        "pairs": [_pair_summary(plan) for plan in plans],
        "total": {
            "segments": sum(p.chosen.num_ops for p in plans),
            "bytes": sum(p.chosen.nbytes for p in plans),
            # Each source rank's NIC serializes its own writes; ranks run in parallel.
            "estimated_seconds": max(per_source.values()),
        },
    }


def _side_summary(spec: KVCacheSpec) -> dict[str, Any]:
    return {
        "tp": spec.tp_size,
        "block_size": spec.block_size,
        "layout": "MLA" if spec.mla else spec.layout,
        "placement": spec.kv_placement,
        "heads_per_rank": spec.heads_per_rank,
    }


def _pair_summary(plan: PairPlan) -> dict[str, Any]:
    r = plan.route
    return {
        "src_rank": plan.src_rank,
        "dst_rank": plan.dst_rank,
        "heads": [r.head_start, r.head_start + r.num_heads],
        "strategy": plan.strategy,
        "segments": plan.chosen.num_ops,
        "bytes": plan.chosen.nbytes,
        "estimated_seconds": plan.chosen.seconds,
        "estimates": {
            e.strategy: {
                "segments": e.num_ops,
                "kernel_passes": e.kernel_passes,
                "estimated_seconds": e.seconds,
            }
            for e in plan.estimates
        },
    }


def format_plan(report: dict[str, Any]) -> str:
    """Human-readable table of a plan report."""
    p, d = report["prefill"], report["decode"]
    lines = [
        f"prefill TP {p['tp']} bs {p['block_size']} {p['layout']}/{p['placement']}  ->  "
        f"decode TP {d['tp']} bs {d['block_size']} {d['layout']}/{d['placement']}",
        f"request: {report['tokens']} tokens, {report['block_allocation']} blocks, "
        f"{report['link']} cost model",
        "",
        f"{'pair':>7}  {'heads':>9}  {'strategy':<12} {'segments':>9} {'bytes':>13} "
        f"{'est. ms':>9}   alternatives (segments / est. ms)",
    ]
    for pair in report["pairs"]:
        heads = f"[{pair['heads'][0]},{pair['heads'][1]})"
        others = "  ".join(
            f"{name} {e['segments']}/{e['estimated_seconds'] * 1e3:.3f}"
            for name, e in pair["estimates"].items()
            if name != pair["strategy"]
        )
        lines.append(
            f"{pair['src_rank']:>3}->{pair['dst_rank']:<3}  {heads:>9}  {pair['strategy']:<12} "
            f"{pair['segments']:>9} {pair['bytes']:>13,} "
            f"{pair['estimated_seconds'] * 1e3:>9.3f}   {others}"
        )
    t = report["total"]
    lines += [
        "",
        f"total: {len(report['pairs'])} pairs, {t['segments']} segments, {t['bytes']:,} bytes, "
        f"estimated {t['estimated_seconds'] * 1e3:.3f} ms (source ranks in parallel)",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The `kvxfer` argument parser."""
    parser = argparse.ArgumentParser(prog="kvxfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser(
        "plan", help="show the remapping plan between two shardings for one request"
    )
    _add_plan_arguments(plan)
    demo = sub.add_parser(
        "demo",
        help="prefill and decode groups, sharded differently, against an unsharded model",
    )
    add_demo_arguments(demo)
    bench = sub.add_parser(
        "bench",
        help="hetero-TP transfer throughput through Mooncake vs a contiguous and a naive write",
    )
    add_bench_arguments(bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvxfer` command."""
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        from kvxfer.bench import run

        return run(args)
    if args.command == "demo":
        from kvxfer.examples.pd_demo import run as run_demo

        return run_demo(args)
    try:
        report = plan_report(args)
    except ValueError as exc:
        print(f"kvxfer plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_plan(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
