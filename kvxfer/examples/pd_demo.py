"""`kvxfer demo`: disaggregated prefill/decode on localhost, sharded differently, checked against
one unsharded model.

The prefill group (one process per rank, gloo for the per-layer all-gather) prefills the prompt
into its paged caches and publishes the request with `KVProducer`; the decode group (one process
per rank) fetches it with `KVConsumer` over Mooncake TCP on 127.0.0.1, then generates tokens
from the moved KV. The demo matches only if every generated token and the last logits equal, bit
for bit, those of the same model run unsharded in one process.

Quiet by default: Mooncake logs errors only (`MC_LOG_LEVEL=ERROR` unless the user set it; INFO
with `--verbose`), and its known-harmless lines are filtered out of every process's stderr
(`kvxfer.cli.native_logs`). On a terminal a progress bar shows the stages; `--json` and output
that is not a terminal get none.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, TextIO

import numpy as np
import torch

from kvxfer.addresses import free_port
from kvxfer.cli.native_logs import filtered_stderr, set_mooncake_log_level
from kvxfer.examples.model import ModelConfig, ShardedModel, init_weights
from kvxfer.spec import KVCacheSpec, allocate_kv_caches

REQUEST = "demo-request"


@dataclass(frozen=True)
class DemoOptions:
    """What `kvxfer demo` runs."""

    prefill_tp: int = 2
    decode_tp: int = 4
    prefill_block_size: int = 16
    decode_block_size: int = 32
    prefill_layout: str = "NHD"
    decode_layout: str = "HND"
    prefill_placement: str = "kv_first"
    decode_placement: str = "kv_first"
    model: str = "gqa"
    prompt_tokens: int = 300
    decode_tokens: int = 16
    kv_heads: int = 24
    strategy: str | None = None
    seed: int = 0
    # The decode's KV cache dtype (the prefill's is float32); an fp8 one holds the prompt's KV
    # quantized with per-layer scales (`decode_scales`), as a calibrated vLLM engine would.
    decode_dtype: str = "float32"

    def config(self) -> ModelConfig:
        """The model both groups and the reference run."""
        mla = self.model == "mla"
        return ModelConfig(
            kv_heads=1 if mla else self.kv_heads,
            q_heads=48 if mla else 2 * self.kv_heads,
            mla=mla,
            max_positions=max(2048, self.prompt_tokens + self.decode_tokens + 1),
            seed=self.seed,
        )

    def decode_scales(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(k_scales, v_scales) of an fp8 decode cache: one per layer, distinct (MLA: K only)."""
        layers = range(self.config().layers)
        k_scales = tuple(0.25 + 0.125 * layer for layer in layers)
        v_scales = () if self.model == "mla" else tuple(0.5 + 0.25 * layer for layer in layers)
        return k_scales, v_scales

    def spec(self, side: str, rank: int) -> KVCacheSpec:
        """The cache geometry of one rank of "prefill", "decode", "reference" (TP 1, as the
        prefill) or "reference-decode" (TP 1, the decode's dtype and scales)."""
        c = self.config()
        tp = {"prefill": self.prefill_tp, "decode": self.decode_tp}.get(side, 1)
        who = "decode" if side == "decode" else "prefill"
        block_size = getattr(self, f"{who}_block_size")
        tokens = self.prompt_tokens + self.decode_tokens + 1
        decoding = side in ("decode", "reference-decode")
        dtype = self.decode_dtype if decoding else "float32"
        k_scales, v_scales = self.decode_scales() if dtype.startswith("float8") else ((), ())
        return KVCacheSpec(
            num_layers=c.layers,
            num_kv_heads=c.cache_heads,
            head_dim=c.cache_head_dim,
            dtype=dtype,  # type: ignore[arg-type]
            k_scales=k_scales,
            v_scales=v_scales,
            tp_size=tp,
            tp_rank=rank,
            block_size=block_size,
            num_blocks=2 * -(-tokens // block_size) + 4,
            layout=getattr(self, f"{who}_layout"),
            kv_placement=getattr(self, f"{who}_placement"),
            mla=c.mla,
        )

    def block_ids(self, spec: KVCacheSpec, salt: int) -> torch.Tensor:
        """A scattered block table covering the prompt and the generated tokens."""
        tokens = self.prompt_tokens + self.decode_tokens + 1
        needed = -(-tokens // spec.block_size)
        rng = np.random.default_rng([self.seed, salt, spec.tp_rank])
        return torch.from_numpy(rng.permutation(spec.num_blocks)[:needed].astype(np.int64))

    def prompt(self) -> torch.Tensor:
        """The prompt's token ids."""
        gen = torch.Generator().manual_seed(self.seed + 1)
        return torch.randint(0, self.config().vocab, (self.prompt_tokens,), generator=gen)


def generate(model: ShardedModel, first: int, start: int, steps: int, block_ids: torch.Tensor):
    """Greedy decoding from token `first` at position `start`; tokens and the last logits."""
    tokens, logits = [first], None
    for step in range(steps):
        logits = model.forward(torch.tensor([tokens[-1]]), start + step, block_ids)[-1]
        tokens.append(int(torch.argmax(logits)))
    return tokens, logits


def reference(options: DemoOptions) -> tuple[list[int], torch.Tensor]:
    """The unsharded model in this process: prefill, then decode. With another decode dtype,
    the decode runs over a cache of that dtype (fp8: with the decode's scales) holding the
    prompt's KV as that cache's own write stores it, as a decode engine of that dtype would."""
    config = options.config()
    weights = init_weights(config)
    spec = options.spec("reference", 0)
    caches = allocate_kv_caches(spec)
    ids = options.block_ids(spec, salt=0)
    model = ShardedModel(config, weights, spec, caches)
    first = int(torch.argmax(model.forward(options.prompt(), 0, ids)[-1]))
    if options.decode_dtype != spec.dtype:
        decode_spec = options.spec("reference-decode", 0)
        decoder = ShardedModel(config, weights, decode_spec, allocate_kv_caches(decode_spec))
        for layer in range(config.layers):  # the prompt's KV, stored by the decode's cache
            prompt_kv = model._read_kv(layer, ids, options.prompt_tokens)
            decoder._write_kv(layer, prompt_kv, ids, 0)
        model = decoder
    tokens, logits = generate(model, first, options.prompt_tokens, options.decode_tokens, ids)
    assert logits is not None
    return tokens, logits


def _gather_fn(tp: int):
    if tp == 1:
        return None
    import torch.distributed as dist

    def gather(x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(tp)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    return gather


def _join_group(port: int, rank: int, tp: int) -> None:
    torch.set_num_threads(1)  # same kernels as the reference: bit-exact results
    if tp > 1:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp
        )


def prefill_rank(options: dict, rank: int, port: int, conn) -> None:
    """One prefill rank: prefill, publish, serve until told to stop."""
    from kvxfer.connector import KVProducer

    try:
        opts = DemoOptions(**options)
        _join_group(port, rank, opts.prefill_tp)
        config, spec = opts.config(), opts.spec("prefill", rank)
        caches = allocate_kv_caches(spec)
        ids = opts.block_ids(spec, salt=1)
        model = ShardedModel(config, init_weights(config), spec, caches, _gather_fn(spec.tp_size))
        began = time.perf_counter()
        first = int(torch.argmax(model.forward(opts.prompt(), 0, ids)[-1]))
        prefill_s = time.perf_counter() - began
        released: list[str] = []
        release = lambda rid, _why: released.append(rid)  # noqa: E731
        with KVProducer(spec, caches, "prefill", release=release) as producer:
            producer.publish(REQUEST, ids.numpy(), opts.prompt_tokens)
            conn.send({"address": producer.address, "first": first, "prefill_s": prefill_s})
            assert conn.recv() == "stop"
            deadline = time.monotonic() + 5
            while not released and time.monotonic() < deadline:
                time.sleep(0.01)
            conn.send({"released": released})
    except Exception:
        conn.send({"error": traceback.format_exc()})


def decode_rank(options: dict, rank: int, port: int, addresses: list[str], first: int, conn):
    """One decode rank: handshake, fetch the prompt's KV, generate."""
    from kvxfer.connector import KVConsumer

    try:
        opts = DemoOptions(**options)
        _join_group(port, rank, opts.decode_tp)
        config, spec = opts.config(), opts.spec("decode", rank)
        caches = allocate_kv_caches(spec)
        for t in caches:
            t.view(torch.uint8).fill_(0xA5)  # poison: KV that did not arrive cannot go unseen
        ids = opts.block_ids(spec, salt=2)
        with KVConsumer(spec, caches, "decode", strategy=opts.strategy) as consumer:
            plans = consumer.connect(addresses)
            conn.send({"connected": True})
            assert conn.recv() == "fetch"
            result = consumer.fetch(REQUEST, ids.numpy(), opts.prompt_tokens, timeout=60).wait()
            report: dict[str, Any] = {
                "rank": rank,
                "result": asdict(result),
                "plans": [
                    {
                        "src_rank": p.src_rank,
                        "dst_rank": p.dst_rank,
                        "heads": {
                            "start": p.route.head_start,
                            "stop": p.route.head_start + p.route.num_heads,
                        },
                        "strategy": p.strategy,
                    }
                    for p in plans
                ],
            }
            if result.ok:
                model = ShardedModel(
                    config, init_weights(config), spec, caches, _gather_fn(spec.tp_size)
                )
                began = time.perf_counter()
                tokens, logits = generate(model, first, opts.prompt_tokens, opts.decode_tokens, ids)
                report.update(
                    tokens=tokens, logits=logits.numpy(), decode_s=time.perf_counter() - began
                )
        # Sent once the consumer has closed: the prefill ranks stop on it, and a producer that
        # closes first would be logged as a dead peer on a consumer still closing.
        conn.send(report)
    except Exception:
        conn.send({"error": traceback.format_exc()})


class _Progress:
    """The demo's stages as one tqdm bar on a terminal (`stream` a TTY); nothing otherwise."""

    def __init__(self, total: int, stream: TextIO | None) -> None:
        self.bar: Any = None
        if stream is None or not stream.isatty():
            return
        try:
            from tqdm import tqdm
        except ImportError:  # progress is a courtesy: the demo runs without it
            return
        self.bar = tqdm(
            total=total,
            file=stream,
            leave=False,
            dynamic_ncols=True,
            bar_format="{desc} {bar} {n_fmt}/{total_fmt} [{elapsed}]",
        )

    def start(self, what: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(what)

    def done(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _receive(conn, who: str, timeout: float = 300.0) -> dict:
    if not conn.poll(timeout):
        raise TimeoutError(f"{who} did not answer within {timeout} s")
    message = conn.recv()
    if "error" in message:
        raise RuntimeError(f"{who} failed:\n{message['error']}")
    return message


def run_demo(options: DemoOptions, progress: TextIO | None = None) -> dict[str, Any]:
    """Run the whole demo; return its report (`match` tells the outcome).

    `progress`: where to draw a progress bar of the stages, if it is a terminal.
    """
    stages = _Progress(5, progress)
    ctx = mp.get_context("spawn")
    opts = asdict(options)
    procs: list[Any] = []
    try:
        stages.start("reference: the unsharded model in one process")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the ranks use one thread too: same kernels, same bits
        want_tokens, want_logits = reference(options)
        torch.set_num_threads(threads)
        stages.done()

        stages.start(f"prefill: {options.prefill_tp} ranks prefill {options.prompt_tokens} tokens")
        port = free_port()
        prefill = []
        for rank in range(options.prefill_tp):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=prefill_rank, args=(opts, rank, port, child), daemon=True)
            proc.start()
            procs.append(proc)
            prefill.append(parent)
        ready = [_receive(c, f"prefill rank {r}") for r, c in enumerate(prefill)]
        firsts = {m["first"] for m in ready}
        if len(firsts) != 1:
            raise RuntimeError(f"prefill ranks disagree on the first token: {firsts}")
        first = firsts.pop()
        stages.done()

        stages.start(f"decode: {options.decode_tp} ranks start and shake hands")
        port = free_port()
        addresses = [m["address"] for m in ready]
        decode = []
        for rank in range(options.decode_tp):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=decode_rank, args=(opts, rank, port, addresses, first, child), daemon=True
            )
            proc.start()
            procs.append(proc)
            decode.append(parent)
        for r, c in enumerate(decode):
            _receive(c, f"decode rank {r}")
        stages.done()

        stages.start("transfer and decode")
        for c in decode:
            c.send("fetch")
        reports = [_receive(c, f"decode rank {r}") for r, c in enumerate(decode)]
        stages.done()

        stages.start("release on the prefill side")
        for c in prefill:
            c.send("stop")
        released = [_receive(c, f"prefill rank {r}")["released"] for r, c in enumerate(prefill)]
        stages.done()
    finally:
        stages.close()
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    return _report(options, reports, released, want_tokens, want_logits)


def _report(options, reports, released, want_tokens, want_logits) -> dict[str, Any]:
    results = [r["result"] for r in reports]
    ok = all(r["ok"] for r in results)
    got = reports[0]
    tokens = got.get("tokens")
    logits = torch.from_numpy(got["logits"]) if "logits" in got else None
    same_logits = logits is not None and torch.equal(logits, want_logits)
    ranks_agree = all(r.get("tokens") == tokens for r in reports)
    seconds = max(r["seconds"] for r in results)
    nbytes = sum(r["bytes"] for r in results)
    return {
        "match": bool(ok and ranks_agree and tokens == want_tokens and same_logits),
        "transfer_ok": ok,
        "tokens": tokens,
        "reference_tokens": want_tokens,
        "logits_max_abs_diff": (
            float((logits - want_logits).abs().max()) if logits is not None else None
        ),
        "strategies": sorted({p["strategy"] for r in reports for p in r["plans"]}),
        "pairs": [p for r in reports for p in r["plans"]],
        "bytes": nbytes,
        "num_ops": sum(r["num_ops"] for r in results),
        "transfer_seconds": seconds,
        "throughput_mb_s": nbytes / seconds / 1e6 if seconds > 0 else 0.0,
        "per_rank": [
            {
                "rank": r["rank"],
                **{k: r["result"][k] for k in ("ok", "bytes", "num_ops", "seconds")},
            }
            for r in reports
        ],
        "errors": [e for r in results for e in r["errors"]],
        "released": released,
        "options": asdict(options),
    }


def format_report(report: dict[str, Any]) -> str:
    """The human-readable summary."""
    o = report["options"]
    lines = [
        f"model: {o['model'].upper()}, prompt {o['prompt_tokens']} tokens, "
        f"{o['decode_tokens']} decode tokens",
        f"prefill TP {o['prefill_tp']} (blocks of {o['prefill_block_size']}, "
        f"{o['prefill_layout']}/{o['prefill_placement']}) -> decode TP {o['decode_tp']} "
        f"(blocks of {o['decode_block_size']}, {o['decode_layout']}/{o['decode_placement']})",
        "plan:",
    ]
    for p in report["pairs"]:
        lines.append(
            f"  prefill {p['src_rank']} -> decode {p['dst_rank']}  "
            f"kv heads [{p['heads']['start']},{p['heads']['stop']})  {p['strategy']}"
        )
    lines.append("transfer:")
    for r in report["per_rank"]:
        lines.append(
            f"  decode rank {r['rank']}: {r['bytes']:,} bytes, {r['num_ops']} ops, "
            f"{r['seconds'] * 1e3:.1f} ms" + ("" if r["ok"] else "  FAILED")
        )
    lines.append(
        f"  total {report['bytes']:,} bytes, {report['num_ops']} ops, "
        f"{report['transfer_seconds'] * 1e3:.1f} ms, {report['throughput_mb_s']:.1f} MB/s"
    )
    lines.append(f"tokens    {report['tokens']}")
    lines.append(f"reference {report['reference_tokens']}")
    if report["logits_max_abs_diff"] is not None:
        lines.append(f"last logits: max |difference| {report['logits_max_abs_diff']:g}")
    for error in report["errors"]:
        lines.append(f"error: {error}")
    lines.append("MATCH" if report["match"] else "MISMATCH")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """`kvxfer demo`: exit 0 only on a match."""
    fields = DemoOptions.__dataclass_fields__
    options = DemoOptions(**{k: v for k, v in vars(args).items() if k in fields})
    try:
        for side in ("prefill", "decode"):
            options.spec(side, 0)  # bad geometry fails here, with the field named
        if options.prompt_tokens < 1 or options.decode_tokens < 1:
            raise ValueError("--prompt-tokens and --decode-tokens must be at least 1")
        if options.config().q_heads % max(options.prefill_tp, options.decode_tp):
            raise ValueError("the query heads do not split over that TP size")
    except ValueError as exc:
        print(f"kvxfer demo: {exc}", file=sys.stderr)
        return 2
    verbose = bool(getattr(args, "verbose", False))
    set_mooncake_log_level(verbose)  # before any engine starts; the ranks inherit it
    if verbose:  # everything Mooncake says, unfiltered
        report = run_demo(options, None if args.json else sys.stderr)
    else:
        with filtered_stderr() as console:
            report = run_demo(options, None if args.json else console)
    if args.json:
        print(json.dumps({k: v for k, v in report.items()}, indent=2, default=str))
    else:
        print(format_report(report))
    return 0 if report["match"] else 1
