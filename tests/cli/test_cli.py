"""The `kvxfer` command line: `plan` prints the plan (a table or JSON); every bad flag or value
gets one line naming it and exit code 2; `--help` shows defaults and answers at once, because
parsing imports no heavy module."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from helpers import REPO

from kvxfer import cli
from kvxfer.cli import main, parse_args
from kvxfer.rdma import rdma_devices

ENV = {**os.environ, "MC_LOG_LEVEL": "ERROR"}
HEAVY = ("torch", "numpy", "triton", "mooncake", "msgspec", "zmq")

ARGS = [
    "plan",
    "--prefill-tp",
    "3",
    "--decode-tp",
    "4",
    "--kv-heads",
    "12",
    "--prefill-block-size",
    "16",
    "--decode-block-size",
    "48",
    "--decode-layout",
    "HND",
    "--num-layers",
    "4",
    "--head-dim",
    "64",
    "--tokens",
    "300",
]


def kvxfer(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
    )


# ---- plan -------------------------------------------------------------------------------------


def test_plan_json(capsys):
    assert main([*ARGS, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    pairs = report["pairs"]
    assert [(p["src_rank"], p["dst_rank"], p["heads"]) for p in pairs] == [
        (0, 0, {"start": 0, "stop": 3}),
        (0, 1, {"start": 3, "stop": 4}),
        (1, 1, {"start": 4, "stop": 6}),
        (1, 2, {"start": 6, "stop": 8}),
        (2, 2, {"start": 8, "stop": 9}),
        (2, 3, {"start": 9, "stop": 12}),
    ]
    for p in pairs:
        heads = p["heads"]["stop"] - p["heads"]["start"]
        assert p["bytes"] == 4 * 2 * 300 * heads * 64 * 2
        assert set(p["estimates"]) == {"direct", "pack", "unpack", "pack+unpack"}
        best = min(p["estimates"].values(), key=lambda e: e["estimated_seconds"])
        assert p["estimated_seconds"] == best["estimated_seconds"]
    assert report["total"]["bytes"] == 4 * 2 * 300 * 12 * 64 * 2


def test_plan_json_keys(capsys):
    """Every key docs/cli.md ("Command-line reference (JSON keys)") documents, and no other."""
    assert main([*ARGS, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {
        "tokens",
        "block_allocation",
        "link",
        "prefill",
        "decode",
        "pairs",
        "total",
    }
    side = {"tp", "block_size", "layout", "placement", "heads_per_rank", "dtype"}
    assert set(report["prefill"]) == set(report["decode"]) == side
    assert report["decode"] == {
        "tp": 4,
        "block_size": 48,
        "layout": "HND",
        "placement": "kv_first",
        "heads_per_rank": 3,
        "dtype": "bfloat16",
    }
    pair = {
        "src_rank",
        "dst_rank",
        "heads",
        "strategy",
        "segments",
        "bytes",
        "estimated_seconds",
        "estimates",
        "converts_on",
    }
    for p in report["pairs"]:
        assert set(p) == pair
        for e in p["estimates"].values():
            assert set(e) == {"segments", "kernel_passes", "estimated_seconds"}
    assert set(report["total"]) == {"segments", "bytes", "estimated_seconds"}
    assert (report["tokens"], report["block_allocation"], report["link"]) == (
        300,
        "scattered",
        "rdma",
    )


def test_plan_mla_and_replicated_heads(capsys):
    assert main(["plan", "--mla", "--prefill-tp", "2", "--decode-tp", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prefill"]["layout"] == "MLA"
    assert {(p["heads"]["start"], p["heads"]["stop"]) for p in report["pairs"]} == {(0, 1)}
    assert main(["plan", "--mla", "--kv-heads", "1", "--json"]) == 0  # 1 is the latent head


def test_plan_forced_strategy(capsys):
    assert main([*ARGS, "--json", "--strategy", "direct"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {p["strategy"] for p in report["pairs"]} == {"direct"}


@pytest.mark.parametrize(
    ("decode_dtype", "side", "wire_itemsize"),
    [("float8_e4m3fn", "source", 1), ("float32", "destination", 2)],
)
def test_plan_with_a_decode_dtype_converts_where_the_wire_is_narrower(
    capsys, decode_dtype, side, wire_itemsize
):
    assert main([*ARGS, "--json", "--decode-dtype", decode_dtype]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["prefill"]["dtype"], report["decode"]["dtype"]) == ("bfloat16", decode_dtype)
    for p in report["pairs"]:
        assert "direct" not in p["estimates"]  # a byte copy cannot convert
        assert p["strategy"] == "pack+unpack" or p["converts_on"] == (
            "source" if p["strategy"] == "pack" else "destination"
        )
        if p["strategy"] == "pack+unpack":
            assert p["converts_on"] == side
    forced = [*ARGS, "--json", "--decode-dtype", decode_dtype, "--strategy", "pack+unpack"]
    assert main(forced) == 0
    wire = json.loads(capsys.readouterr().out)
    heads, tokens, layers, dim = 12, 300, 4, 64
    assert wire["total"]["bytes"] == layers * 2 * tokens * heads * dim * wire_itemsize
    assert {p["converts_on"] for p in wire["pairs"]} == {side}
    assert main([*ARGS, "--json"]) == 0
    same = json.loads(capsys.readouterr().out)
    assert {p["converts_on"] for p in same["pairs"]} == {None}


def test_plan_table_runs_as_a_command():
    done = kvxfer(*ARGS)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "prefill TP 3 bs 16 NHD/kv_first bfloat16  ->  decode TP 4 bs 48 HND/kv_first" in out
    assert "0->1" in out and "[3,4)" in out
    assert "total: 6 pairs" in out


# ---- bad flags and values: one line, exit code 2 ----------------------------------------------

BAD = [
    # (argv, what the line must name, a piece of the accepted form)
    (["bench", "--pairs", "2x4"], "--pairs", "2:4,4:2"),
    (["bench", "--pairs", "2:5"], "--pairs", "TP 5"),
    (["bench", "--pairs", "2:0"], "--pairs", ">= 1"),
    (["bench", "--pairs", "2:4,"], "--pairs", "2:4,4:2"),
    (["bench", "--pairs", "3:4", "--kv-heads", "2"], "--pairs", "multiple of 2"),
    (["bench", "--tokens", "0"], "--tokens", ">= 1"),
    (["bench", "--tokens", "many"], "--tokens", ">= 1"),
    (["bench", "--repeat", "0"], "--repeat", ">= 1"),
    (["bench", "--kv-heads", "-3"], "--kv-heads", ">= 1"),
    (["bench", "--staging-slots", "0"], "--staging-slots", ">= 1"),
    (["bench", "--protocol", "udp"], "--protocol", "'tcp'"),
    (["bench", "--strategy", "fast"], "--strategy", "'pack+unpack'"),
    (["bench", "--no-such-flag"], "--no-such-flag", "kvxfer bench --help"),
    (["plan", "--mla", "--kv-heads", "8"], "--kv-heads", "--mla"),
    (["plan", "--kv-heads", "6", "--decode-tp", "4"], "--decode-tp", "must divide 6"),
    (["plan", "--dtype", "int8"], "--dtype", "'bfloat16'"),
    (["plan", "--tokens", "-5"], "--tokens", ">= 1"),
    (["plan", "--prefill-tp", "0"], "--prefill-tp", ">= 1"),
    (["plan", "--decode-layout", "NCHW"], "--decode-layout", "'HND'"),
    (["plan", "--prefill-placement", "kv_last"], "--prefill-placement", "'kv_inner'"),
    (["plan", "--link", "ethernet"], "--link", "'tcp'"),
    (["demo", "--decode-tp", "5"], "--decode-tp", "num_kv_heads"),
    (["demo", "--model", "mla", "--kv-heads", "8"], "--kv-heads", "--model mla"),
    (["demo", "--model", "mla", "--prefill-tp", "5"], "--prefill-tp", "divides 48"),
    (["demo", "--model", "moe"], "--model", "'mla'"),
    (["demo", "--prompt-tokens", "0"], "--prompt-tokens", ">= 1"),
    (["demo", "--decode-block-size", "0"], "--decode-block-size", ">= 1"),
    (["demo", "--seed", "-1"], "--seed", ">= 0"),
    (["doctor", "--timeout", "0"], "--timeout", ">= 1"),
    ([], "plan,bench,demo,doctor", "kvxfer --help"),
    (["frobnicate"], "frobnicate", "'doctor'"),
]


@pytest.mark.parametrize("argv, names, accepted", BAD, ids=[" ".join(b[0]) or "-" for b in BAD])
def test_a_bad_flag_or_value_gets_one_line_and_exit_code_2(argv, names, accepted):
    done = kvxfer(*argv)
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    (line,) = lines
    prog = " ".join(["kvxfer", *argv[:1]]) if argv and argv[0] in cli._COMMANDS else "kvxfer"
    assert line.startswith(f"{prog}: error: "), line
    assert names in line and accepted in line, line


@pytest.mark.skipif(bool(rdma_devices()), reason="this machine has an RDMA device")
def test_bench_rdma_without_a_device_is_refused_with_one_line():
    done = kvxfer("bench", "--protocol", "rdma")
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert "--protocol" in line and "--protocol tcp" in line and "Traceback" not in line


def test_bad_values_are_refused_before_any_heavy_import():
    code = f"""
import sys
from kvxfer.cli import main
for argv in {[b[0] for b in BAD]!r}:
    try:
        main(argv)
    except SystemExit as exc:
        assert exc.code == 2, (argv, exc.code)
    else:
        raise AssertionError(argv)
print(sorted(m for m in {HEAVY!r} if m in sys.modules))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_what_only_the_library_catches_is_one_line_too(capsys, monkeypatch):
    args = parse_args(["plan", "--json"])
    args.head_dim = 0  # past the parser's checks: KVCacheSpec names the field
    with pytest.raises(ValueError, match="head_dim"):
        cli.plan_report(args)

    def refuse(args):
        raise ValueError("KVCacheSpec.head_dim: must be positive;\n  pass a value >= 1")

    monkeypatch.setattr(cli, "plan_report", refuse)
    assert main(["plan"]) == 2
    err = capsys.readouterr().err
    assert err == "kvxfer plan: error: KVCacheSpec.head_dim: must be positive; pass a value >= 1\n"


# ---- --help: fast, with defaults --------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, defaults",
    [
        ([], ["plan", "bench", "demo", "doctor"]),
        (["plan"], ["(default: 4096)", "(default: 8;", "(default: bfloat16)", "(default: rdma)"]),
        (["bench"], ["(default: 2:4,4:2,3:4)", "(default: 12)", "(default: tcp)"]),
        (["demo"], ["(default: 2)", "(default: 300)", "(default: 24;", "(default: HND)"]),
        (["doctor"], ["(default: 120)"]),
    ],
    ids=["kvxfer", "plan", "bench", "demo", "doctor"],
)
def test_help_shows_defaults(argv, defaults):
    """(`--help` stays fast, 0.04-0.06 s here where it took 4-8 s, because the CLI imports no
    heavy module: the next test checks that exactly, not by this machine's speed.)"""
    done = kvxfer(*argv, "--help")
    assert done.returncode == 0, done.stderr
    out = " ".join(done.stdout.split())  # argparse wraps lines
    for text in defaults:
        assert text in out, (text, done.stdout)


def test_importing_the_cli_imports_no_heavy_module():
    code = (
        "import sys, kvxfer, kvxfer.cli, kvxfer.cli.doctor; "
        "kvxfer.cli.build_parser(); "
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=ENV
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_lazy_package_still_exports_the_api():
    import kvxfer
    import kvxfer.reshard
    from kvxfer import KVCacheSpec, reshard

    assert callable(reshard) and kvxfer.reshard is reshard  # the function, not the module
    assert KVCacheSpec.__module__ == "kvxfer.spec"
    assert set(kvxfer.__all__) <= set(dir(kvxfer))
    with pytest.raises(AttributeError):
        _ = kvxfer.no_such_name


# ---- the copies of library names in kvxfer.cli ------------------------------------------------


def test_the_cli_choices_match_the_library():
    from kvxfer.plan import STRATEGIES
    from kvxfer.spec import KV_PLACEMENTS, LAYOUTS, TORCH_DTYPES
    from kvxfer.transport.mooncake import PROTOCOLS

    assert cli.STRATEGIES == STRATEGIES
    assert cli.KV_PLACEMENTS == KV_PLACEMENTS
    assert cli.LAYOUTS == LAYOUTS
    assert set(cli.DTYPES) == set(TORCH_DTYPES)
    assert cli.PROTOCOLS == PROTOCOLS


def test_the_demo_flags_cover_every_demo_option():
    """kvxfer.cli parses `kvxfer demo` (so `--help` imports no torch): a DemoOptions field
    without a flag there, or another default, fails here."""
    from kvxfer.examples.pd_demo import DemoOptions

    defaults = DemoOptions()
    assert dataclasses.asdict(defaults) == cli.DEMO_DEFAULTS
    assert DemoOptions(model="mla").config().q_heads == cli.DEMO_MLA_Q_HEADS
    args = vars(parse_args(["demo"]))
    assert {k: args[k] for k in cli.DEMO_DEFAULTS} == cli.DEMO_DEFAULTS


def test_bench_pairs_are_parsed():
    args = parse_args(["bench", "--pairs", "2:4, 4:2,1:8", "--kv-heads", "8"])
    assert args.pairs == [(2, 4), (4, 2), (1, 8)]
    assert parse_args(["bench"]).pairs == [(2, 4), (4, 2), (3, 4)]


def cli_reference() -> str:
    """The JSON-key reference, docs/cli.md."""
    return (REPO / "docs" / "cli.md").read_text()


def json_keys(value: object) -> set[str]:
    """Every key of a JSON value, at any depth (strategy names as keys count too)."""
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in json_keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in json_keys(v)}
    return set()


def test_the_cli_reference_documents_every_json_key_of_plan_and_demo(capsys):
    import numpy as np
    import torch

    from kvxfer.examples.pd_demo import DemoOptions, _report

    section = cli_reference()
    assert main([*ARGS, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    for key in json_keys(plan):
        assert f"`{key}`" in section, f"plan: {key}"
    logits = np.zeros(4, dtype=np.float32)
    reports = [
        {
            "rank": 0,
            "result": {"ok": True, "bytes": 1, "num_ops": 1, "seconds": 0.1, "errors": []},
            "plans": [
                {
                    "src_rank": 0,
                    "dst_rank": 0,
                    "heads": {"start": 0, "stop": 1},
                    "strategy": "direct",
                }
            ],
            "tokens": [1],
            "logits": logits,
        }
    ]
    demo = _report(DemoOptions(), reports, [["demo-request"]], [1], torch.from_numpy(logits))
    demo = json.loads(json.dumps(demo, default=str))
    for key in json_keys(demo):
        assert f"`{key}`" in section, f"demo: {key}"


def test_bench_defaults_are_the_connectors():
    """The CLI keeps its parsing light, so it spells the staging default out: the same value."""
    from kvxfer.cli.bench import BenchConfig
    from kvxfer.plan import DEFAULT_STAGING_SLOTS

    args = parse_args(["bench"])
    assert args.staging_slots == DEFAULT_STAGING_SLOTS == BenchConfig.staging_slots
