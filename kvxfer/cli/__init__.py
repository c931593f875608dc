"""The `kvxfer` command line: `kvxfer plan`, `kvxfer bench`, `kvxfer demo` and `kvxfer doctor`.

This module parses every command and runs `plan`; the others run in their own modules beside
it (`bench.py`, `doctor.py` with its subprocess probes in `doctor_probes.py`, and
`kvxfer.examples.pd_demo`), and `native_logs.py` quiets Mooncake's native log lines for the
commands and examples that start Mooncake engines.

Only the standard library is imported here: each command imports torch, numpy, Triton or
Mooncake when it runs, so `--help` and a bad flag answer at once. Every bad flag or value gets
one line on stderr naming it and the accepted form, and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from kvxfer.plan import PairPlan
    from kvxfer.spec import KVCacheSpec

# The library's names, copied so that parsing imports nothing heavy; tests/cli/test_cli.py checks
# that they match kvxfer.plan.STRATEGIES, kvxfer.spec.KV_PLACEMENTS and the demo's defaults.
STRATEGIES: tuple[str, ...] = ("direct", "pack", "unpack", "pack+unpack")
KV_PLACEMENTS: tuple[str, ...] = ("kv_first", "blocks_first", "kv_inner")
LAYOUTS: tuple[str, ...] = ("NHD", "HND")
DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2")
PROTOCOLS: tuple[str, ...] = ("tcp", "rdma")
PLAN_KV_HEADS = 8
DEMO_DEFAULTS: dict[str, Any] = {
    "prefill_tp": 2,
    "decode_tp": 4,
    "prefill_block_size": 16,
    "decode_block_size": 32,
    "prefill_layout": "NHD",
    "decode_layout": "HND",
    "prefill_placement": "kv_first",
    "decode_placement": "kv_first",
    "model": "gqa",
    "prompt_tokens": 300,
    "decode_tokens": 16,
    "kv_heads": 24,
    "strategy": None,
    "seed": 0,
    "decode_dtype": "float32",
}
DEMO_MLA_Q_HEADS = 48  # the demo model's query heads with --model mla (2 x KV heads for gqa)

_SIDES = ("prefill", "decode")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: `prog: error: what (see 'prog --help')`."""

    def error(self, message: str) -> NoReturn:
        message = " ".join(message.split())  # one line, whatever argparse built
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows `(default: ...)` after every option that has a default worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            "%(default)" in text
            or not action.option_strings
            or action.default is None
            or action.default is False
            or action.default is argparse.SUPPRESS
        ):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def _at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `low`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


_positive = _at_least(1)
_non_negative = _at_least(0)


def _tp_pairs(text: str) -> list[tuple[int, int]]:
    """An argparse type: comma-separated `prefill:decode` TP sizes, such as `2:4,4:2`."""
    pairs = []
    for part in text.split(","):
        src, sep, dst = part.strip().partition(":")
        try:
            pair = (int(src), int(dst))
        except ValueError:
            pair = (0, 0)
        if not sep or min(pair) < 1:
            raise argparse.ArgumentTypeError(
                "expected prefill:decode TP sizes (integers >= 1), comma-separated, such as "
                f"2:4,4:2; got {text!r}"
            )
        pairs.append(pair)
    return pairs


def _heads_fit(heads: int, tp: int, flag: str = "--kv-heads") -> str | None:
    """Why `heads` KV heads cannot be sharded over TP `tp` (as KVCacheSpec checks), or None."""
    if heads >= tp and heads % tp:
        return (
            f"{heads} KV heads ({flag}) cannot be split evenly over TP {tp}: a TP size up to "
            f"{heads} must divide {heads}"
        )
    if heads < tp and tp % heads:
        return (
            f"{heads} KV heads ({flag}) cannot be replicated evenly over TP {tp}: a TP size "
            f"above {heads} must be a multiple of {heads}"
        )
    return None


# ---- kvxfer plan ------------------------------------------------------------------------------


def _add_plan_arguments(p: argparse.ArgumentParser) -> None:
    model = p.add_argument_group("model")
    model.add_argument("--num-layers", type=_positive, default=32, help="attention layers")
    model.add_argument(
        "--kv-heads",
        type=_positive,
        help=f"global KV heads (default: {PLAN_KV_HEADS}; an MLA cache has 1, leave it out)",
    )
    model.add_argument("--head-dim", type=_positive, default=128, help="elements per head")
    model.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="cache dtype")
    model.add_argument(
        "--decode-dtype",
        choices=DTYPES,
        help="the decode's cache dtype, when it differs (e.g. float8_e4m3fn: the kernels "
        "convert, with scales 1.0 here; default: --dtype)",
    )
    model.add_argument("--mla", action="store_true", help="an MLA latent cache (one head)")
    defaults = {"prefill": (2, 16), "decode": (4, 16)}
    for side in _SIDES:
        group = p.add_argument_group(side)
        tp, bs = defaults[side]
        group.add_argument(f"--{side}-tp", type=_positive, default=tp, help="TP size")
        group.add_argument(
            f"--{side}-block-size", type=_positive, default=bs, help="tokens per block"
        )
        group.add_argument(
            f"--{side}-layout", choices=LAYOUTS, default="NHD", help="inside a block"
        )
        group.add_argument(
            f"--{side}-placement", choices=KV_PLACEMENTS, default="kv_first", help="K/V planes"
        )
    req = p.add_argument_group("request and cost model")
    req.add_argument("--tokens", type=_positive, default=4096, help="tokens in the request")
    req.add_argument(
        "--strategy",
        choices=STRATEGIES,
        help="force one strategy for every pair (default: the cost model picks per pair)",
    )
    req.add_argument(
        "--contiguous-blocks",
        action="store_true",
        help="assume consecutive block ids (default: scattered, no two adjacent)",
    )
    req.add_argument(
        "--link",
        choices=PROTOCOLS[::-1],
        default="rdma",
        help="cost-model constants: 400 Gbps RDMA or TCP on loopback",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _check_plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.mla and args.kv_heads not in (None, 1):
        parser.error(
            f"argument --kv-heads: an MLA cache has one latent head, got {args.kv_heads}; "
            "leave --kv-heads out with --mla"
        )
    heads = _plan_heads(args)
    for side in _SIDES:
        why = _heads_fit(heads, getattr(args, f"{side}_tp"))
        if why:
            parser.error(f"argument --{side}-tp: {why}")


def _plan_heads(args: argparse.Namespace) -> int:
    if args.mla:
        return 1
    return PLAN_KV_HEADS if args.kv_heads is None else int(args.kv_heads)


def _side_specs(args: argparse.Namespace, side: str) -> list[KVCacheSpec]:
    from kvxfer.plan.cost import reference_block_ids
    from kvxfer.spec import KVCacheSpec

    tp = getattr(args, f"{side}_tp")
    block_size = getattr(args, f"{side}_block_size")
    needed = len(reference_block_ids(args.tokens, block_size, args.contiguous_blocks))
    return KVCacheSpec(
        num_layers=args.num_layers,
        num_kv_heads=_plan_heads(args),
        head_dim=args.head_dim,
        dtype=args.decode_dtype or args.dtype if side == "decode" else args.dtype,
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
    from dataclasses import replace

    from kvxfer.plan import CostModel, plan_pairs
    from kvxfer.plan.program import conversion_side

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
        "pairs": [
            {**_pair_summary(plan), "converts_on": conversion_side(plan.strategy, src[0], dst[0])}
            for plan in plans
        ],
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
        "dtype": spec.dtype,
    }


def _pair_summary(plan: PairPlan) -> dict[str, Any]:
    r = plan.route
    return {
        "src_rank": plan.src_rank,
        "dst_rank": plan.dst_rank,
        # The global KV heads [start, stop) this pair moves.
        "heads": {"start": r.head_start, "stop": r.head_start + r.num_heads},
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
        f"prefill TP {p['tp']} bs {p['block_size']} {p['layout']}/{p['placement']} "
        f"{p['dtype']}  ->  decode TP {d['tp']} bs {d['block_size']} "
        f"{d['layout']}/{d['placement']} {d['dtype']}",
        f"request: {report['tokens']} tokens, {report['block_allocation']} blocks, "
        f"{report['link']} cost model",
        "",
        f"{'pair':>7}  {'heads':>9}  {'strategy':<12} {'segments':>9} {'bytes':>13} "
        f"{'est. ms':>9}   alternatives (segments / est. ms)",
    ]
    for pair in report["pairs"]:
        heads = f"[{pair['heads']['start']},{pair['heads']['stop']})"
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
    sides = sorted({pair["converts_on"] for pair in report["pairs"]} - {None})
    if sides:
        lines += ["", f"{p['dtype']} -> {d['dtype']}: converted on the {' and '.join(sides)}"]
    lines += [
        "",
        f"total: {len(report['pairs'])} pairs, {t['segments']} segments, {t['bytes']:,} bytes, "
        f"estimated {t['estimated_seconds'] * 1e3:.3f} ms (source ranks in parallel)",
    ]
    return "\n".join(lines)


# ---- kvxfer bench -----------------------------------------------------------------------------


def _add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--pairs",
        type=_tp_pairs,
        default="2:4,4:2,3:4",
        help="prefill:decode TP sizes, comma-separated (one row each)",
    )
    p.add_argument("--kv-heads", type=_positive, default=12, help="global KV heads")
    p.add_argument("--layers", type=_positive, default=8, help="attention layers")
    p.add_argument("--tokens", type=_positive, default=2048, help="tokens in the request")
    p.add_argument("--head-dim", type=_positive, default=128, help="elements per head")
    p.add_argument("--protocol", choices=PROTOCOLS, default="tcp", help="Mooncake transport")
    p.add_argument(
        "--staging-bytes",
        type=_positive,
        default=64 << 20,
        help="staging bytes per peer and side (64 MiB)",
    )
    # kvxfer.plan.DEFAULT_STAGING_SLOTS (not imported here: parsing stays light; a test checks).
    p.add_argument("--staging-slots", type=_positive, default=2, help="chunks in flight per pair")
    p.add_argument(
        "--strategy",
        choices=STRATEGIES,
        help="force one strategy for every pair (default: the cost model picks per pair)",
    )
    p.add_argument("--repeat", type=_positive, default=3, help="timed runs per row (median)")
    p.add_argument(
        "--decode-dtype",
        choices=DTYPES,
        help="the decode's cache dtype (the prefill's is bfloat16; e.g. float8_e4m3fn: the "
        "kernels convert, the wire carries half the bytes)",
    )
    p.add_argument(
        "--torch-threads",
        type=_positive,
        default=1,
        help="intra-op threads of this process (every rank of both engines shares it)",
    )
    p.add_argument("--json", action="store_true", help='print {"rows": [...]}')
    # `kvxfer.testing.results.Benchmark.add_record_flag`'s flag, spelled out: importing the test
    # harness costs a second, and parsing stays light.
    p.add_argument(
        "--record",
        nargs="?",
        const=Path("benchmarks/results"),
        default=None,
        type=Path,
        metavar="DIR",
        help="write the result file for benchmarks/RESULTS.md (default benchmarks/results)",
    )
    _add_verbose(p)


def _add_verbose(p: argparse.ArgumentParser) -> None:
    """The `--verbose` flag of the commands that start Mooncake engines (`native_logs.py`)."""
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show Mooncake's own log lines (INFO level unless MC_LOG_LEVEL is set)",
    )


def _check_bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for src_tp, dst_tp in args.pairs:
        for tp in (src_tp, dst_tp):
            why = _heads_fit(args.kv_heads, tp)
            if why:
                parser.error(f"argument --pairs: in {src_tp}:{dst_tp}, {why}")
    if args.protocol == "rdma":
        from kvxfer.rdma import infiniband_sysfs, rdma_devices

        if not rdma_devices():
            parser.error(
                f"argument --protocol: rdma needs an RDMA device, and {infiniband_sysfs()} lists "
                "none here; use --protocol tcp ('kvxfer doctor' says what this machine has)"
            )


# ---- kvxfer demo ------------------------------------------------------------------------------


def _add_demo_arguments(p: argparse.ArgumentParser) -> None:
    d = DEMO_DEFAULTS
    side_options: tuple[tuple[str, dict[str, Any]], ...] = (  # --{side}-{name}
        ("tp", {"type": _positive, "help": "TP size (ranks)"}),
        ("block-size", {"type": _positive, "help": "tokens per block"}),
        ("layout", {"choices": LAYOUTS, "help": "inside a block"}),
        ("placement", {"choices": KV_PLACEMENTS, "help": "K/V planes"}),
    )
    for side in _SIDES:
        group = p.add_argument_group(side)
        for name, options in side_options:
            default = d[f"{side}_{name.replace('-', '_')}"]
            group.add_argument(f"--{side}-{name}", default=default, **options)
    model = p.add_argument_group("model and request")
    model.add_argument(
        "--model", choices=["gqa", "mla"], default=d["model"], help="GQA heads or an MLA latent"
    )
    model.add_argument(
        "--kv-heads",
        type=_positive,
        help=f"GQA KV heads, 2x as many query heads (default: {d['kv_heads']}; gqa only)",
    )
    model.add_argument(
        "--prompt-tokens", type=_positive, default=d["prompt_tokens"], help="prefilled tokens"
    )
    model.add_argument(
        "--decode-tokens", type=_positive, default=d["decode_tokens"], help="generated tokens"
    )
    model.add_argument(
        "--strategy",
        choices=STRATEGIES,
        help="force one strategy for every pair (default: the cost model picks per pair)",
    )
    model.add_argument("--seed", type=_non_negative, default=d["seed"], help="weights and prompt")
    model.add_argument(
        "--decode-dtype",
        choices=DTYPES,
        default=d["decode_dtype"],
        help="the decode's KV cache dtype (the prefill's is float32; float8_e4m3fn: quantized "
        "with per-layer scales, and the reference decodes over such a cache too)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_verbose(p)


def _check_demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    mla = args.model == "mla"
    if mla and args.kv_heads is not None:
        parser.error(
            "argument --kv-heads: --model mla caches one latent head; leave --kv-heads out "
            "(it sets the heads of --model gqa)"
        )
    if args.kv_heads is None:
        args.kv_heads = DEMO_DEFAULTS["kv_heads"]
    heads = 1 if mla else args.kv_heads
    q_heads = DEMO_MLA_Q_HEADS if mla else 2 * args.kv_heads
    for side in _SIDES:
        tp = getattr(args, f"{side}_tp")
        why = _heads_fit(heads, tp, "--kv-heads, num_kv_heads")  # the library's name too
        if why:
            parser.error(f"argument --{side}-tp: {why}")
        if q_heads % tp:
            parser.error(
                f"argument --{side}-tp: the demo model's {q_heads} query heads do not split over "
                f"TP {tp}; use a TP size that divides {q_heads}"
            )


# ---- kvxfer doctor ----------------------------------------------------------------------------


def _add_doctor_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--timeout",
        type=_positive,
        default=120,
        help="seconds for each check run in a subprocess (a loopback transfer, the kernels, "
        "importing the vLLM integration)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


# ---- the parser -------------------------------------------------------------------------------

_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "plan": ("show the remapping plan between two shardings for one request", _add_plan_arguments),
    "bench": (
        "hetero-TP transfer throughput through Mooncake vs a contiguous and a naive write",
        _add_bench_arguments,
    ),
    "demo": (
        "prefill and decode groups, sharded differently, against an unsharded model",
        _add_demo_arguments,
    ),
    "doctor": (
        "what this machine can do: torch, Triton kernels, Mooncake, RDMA, vLLM",
        _add_doctor_arguments,
    ),
}

_CHECKS: dict[str, Callable[[argparse.ArgumentParser, argparse.Namespace], None]] = {
    "plan": _check_plan,
    "bench": _check_bench,
    "demo": _check_demo,
}


def _build() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser: argparse.ArgumentParser = _Parser(
        prog="kvxfer",
        description="Move LLM KV caches between differently sharded prefill and decode engines.",
        epilog="'kvxfer COMMAND --help' lists a command's options and their defaults.",
        formatter_class=_Formatter,
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{" + ",".join(_COMMANDS) + "}"
    )
    commands: dict[str, argparse.ArgumentParser] = {}
    for name, (text, add) in _COMMANDS.items():
        commands[name] = sub.add_parser(
            name, help=text, description=text, formatter_class=_Formatter
        )
        add(commands[name])
    return parser, commands


def build_parser() -> argparse.ArgumentParser:
    """The `kvxfer` argument parser (its errors are one line; `--help` shows defaults)."""
    return _build()[0]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check a command line; a bad flag or value exits with one line and code 2."""
    parser, commands = _build()
    args, extra = parser.parse_known_args(argv)
    command = commands[args.command]
    if extra:
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    check = _CHECKS.get(args.command)
    if check is not None:
        check(command, args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvxfer` command."""
    args = parse_args(argv)
    if args.command == "bench":
        from kvxfer.cli.bench import run as run_bench

        return run_bench(args)
    if args.command == "demo":
        from kvxfer.examples.pd_demo import run as run_demo

        return run_demo(args)
    if args.command == "doctor":
        from kvxfer.cli.doctor import run as run_doctor

        return run_doctor(args)
    try:
        report = plan_report(args)
    except ValueError as exc:
        print(f"kvxfer plan: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_plan(report))
    return 0
