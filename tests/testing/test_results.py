"""`kvxfer.testing.results`: the result file every benchmark writes with `--record`, read back
as `benchmarks/results_page.py` reads it, and refused when it is not one."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest

from kvxfer.testing.results import (
    MACHINE_KEYS,
    Benchmark,
    Result,
    command_line,
    current_commit,
    describe_machine,
    machine_label,
    read_results,
    verdict,
)

BENCH = Benchmark("demo", "a demonstration", "X=1 python demo.py", Path("unused"))


def _record(directory: Path, argv: list[str], rows: object = None) -> Path | None:
    return BENCH.record(directory, argv, rows or {"a": 1}, lambda rows: ("1 ms", "none"))


def test_a_recorded_run_reads_back_whole(tmp_path):
    path = _record(tmp_path, ["--json", "--record", str(tmp_path)], rows={"rows": [{"ms": 1.5}]})
    assert path == tmp_path / "demo.json"
    (result,) = read_results(tmp_path).values()
    assert result.benchmark == "demo" and result.title == "a demonstration"
    assert result.rows == {"rows": [{"ms": 1.5}]} and result.figure == "1 ms"
    # The command reproduces the run: the base, its arguments, `--record` without the folder.
    assert result.command == "X=1 python demo.py --json --record"
    assert set(result.machine) == MACHINE_KEYS and result.machine["cores"] >= 1
    assert len(result.measured) == 10 and result.commit
    assert Result.from_json(result.to_json()) == result


def test_without_record_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert BENCH.record(None, [], {}, lambda rows: ("", "")) is None
    assert list(tmp_path.iterdir()) == []


def test_the_record_flag_defaults_to_the_benchmarks_folder(tmp_path):
    parser = argparse.ArgumentParser()
    Benchmark("demo", "t", "c", tmp_path / "results").add_record_flag(parser)
    assert parser.parse_args([]).record is None
    assert parser.parse_args(["--record"]).record == tmp_path / "results"
    assert parser.parse_args(["--record", "/x"]).record == Path("/x")


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["--record", "/tmp/r", "--quick"], "b --record --quick"),
        (["--record=/tmp/r"], "b --record"),
        (["--record", "--json"], "b --record --json"),
        (["--only", "kvxfer hetero"], "b --only 'kvxfer hetero'"),
    ],
)
def test_the_command_keeps_the_arguments_but_the_record_folder(argv, command):
    assert command_line("b", argv) == command


def test_a_file_that_is_not_a_result_is_refused_by_name(tmp_path):
    path = _record(tmp_path, [])
    assert path is not None
    data = json.loads(path.read_text())
    del data["commit"]
    data["speed"] = 1
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"missing \['commit'\], unknown \['speed'\]"):
        read_results(tmp_path)


def test_a_file_named_for_another_benchmark_is_refused(tmp_path):
    path = _record(tmp_path, [])
    assert path is not None
    path.rename(tmp_path / "other.json")
    with pytest.raises(ValueError, match="holds benchmark 'demo'; name it after it"):
        read_results(tmp_path)


def test_the_machine_label_names_a_gpu_or_the_cpu_features():
    machine = describe_machine()
    assert machine["cores"] >= 1 and machine["memory_gib"] > 0
    cpu = {"cores": 2, "cpu_capability": "avx512", "amx": True, "gpu": None}
    assert machine_label(cpu) == "2 cores, AVX512, AMX"
    assert machine_label({**cpu, "gpu": "NVIDIA H200"}) == "NVIDIA H200"


def test_a_changed_result_file_does_not_make_the_commit_dirty(tmp_path):
    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "demo.json").write_text("{}")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    clean = current_commit(tmp_path / "benchmarks")
    assert len(clean) == 12 and "dirty" not in clean
    (results / "demo.json").write_text('{"recorded": true}')  # the last run's file
    assert current_commit(tmp_path / "benchmarks") == clean
    (tmp_path / "code.py").write_text("x = 2\n")  # what is measured changed
    assert current_commit(tmp_path / "benchmarks") == f"{clean}-dirty"


@pytest.mark.parametrize(
    ("misses", "unit", "said"),
    [
        ([], "", "met"),
        (["2->4"], "", "not met at 2->4"),
        (["1", "4"], "in flight", "not met at 1, 4 in flight"),
    ],
)
def test_a_verdict_names_what_missed(misses, unit, said):
    assert verdict(misses, unit) == said
