"""The three checks of `kvxfer doctor` that run in a subprocess (`Probe`), so that a hang or
a crash there costs only that check and Mooncake's native log lines stay out of the report: a
real transfer over Mooncake on 127.0.0.1 (a `KVProducer` and a `KVConsumer`, bytes compared
with `reshard`), the Triton kernels against the torch backend on this machine's device, and
importing `kvxfer.integrations.vllm`. Each prints its outcome as one JSON line
(`probe_main`); `kvxfer.cli.doctor` turns the outcomes into checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvxfer.spec import KVCacheSpec


def _tiny_specs() -> tuple[KVCacheSpec, KVCacheSpec]:
    """A small prefill spec (TP 1, NHD blocks of 16) and decode spec (TP 2, HND blocks of 32)."""
    import msgspec

    from kvxfer.spec import KVCacheSpec

    prefill = KVCacheSpec(
        num_layers=2,
        num_kv_heads=4,
        head_dim=16,
        dtype="bfloat16",
        tp_size=1,
        tp_rank=0,
        block_size=16,
        num_blocks=8,
        layout="NHD",
    )
    decode = msgspec.structs.replace(prefill, tp_size=2, block_size=32, num_blocks=4, layout="HND")
    return prefill, decode


def _probe_transfer() -> dict[str, Any]:
    """A KVProducer and a KVConsumer in this process over Mooncake TCP on 127.0.0.1: TP 1 with
    blocks of 16 to TP 2 with blocks of 32, compared with `reshard` (torch backend, CPU)."""
    import numpy as np
    import torch

    from kvxfer import allocate_kv_caches, reshard
    from kvxfer.connector import KVConsumer, KVProducer

    tokens = 40
    src, dst = _tiny_specs()
    src_caches = allocate_kv_caches(src)
    for t in src_caches:
        t.view(torch.int16).random_()
    src_ids = np.asarray([5, 2, 7], np.int64)
    dst_ids = np.asarray([3, 1], np.int64)
    ranks = dst.engine_ranks()
    # Poisoned alike, so bytes the request does not cover compare equal too.
    got = [[t.fill_(7) for t in allocate_kv_caches(s)] for s in ranks]
    want = [[t.fill_(7) for t in allocate_kv_caches(s)] for s in ranks]
    began = time.perf_counter()
    producer = KVProducer(src, src_caches, "doctor-prefill", staging_bytes=1 << 20)
    consumers = [
        KVConsumer(s, c, "doctor-decode", staging_bytes=1 << 20)
        for s, c in zip(ranks, got, strict=True)
    ]
    for c in consumers:
        c.connect([producer.address])
    producer.publish("doctor", src_ids, tokens)
    handles = [c.fetch("doctor", dst_ids, tokens, timeout=30) for c in consumers]
    results = [h.wait() for h in handles]
    seconds = time.perf_counter() - began
    errors = [e for r in results for e in r.errors]
    if errors or not all(r.ok for r in results):
        raise RuntimeError(f"the loopback fetch failed: {errors[:3]}")
    reshard(
        [(src, src_caches, src_ids)],
        [(s, c, dst_ids) for s, c in zip(ranks, want, strict=True)],
        tokens,
        backend="torch",
    )
    if not _same(got, want):
        raise RuntimeError("the loopback fetch landed different bytes than reshard")
    # No close(): destroying the engines takes about a second each; the process exits now.
    return {
        "protocol": consumers[0].transport.protocol,
        "bytes": sum(r.bytes for r in results),
        "seconds": round(seconds, 3),
    }


def _probe_device() -> dict[str, Any]:
    """torch and its device, and the Triton kernels checked against the torch backend on that
    device."""
    import torch

    cuda = bool(torch.cuda.is_available())
    out: dict[str, Any] = {
        "torch": str(torch.__version__),
        "cuda": cuda,
        "cuda_version": torch.version.cuda,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda
        else [],
    }
    # Compiled on a GPU; on CPU only the interpreter runs them, chosen before they are imported.
    os.environ["TRITON_INTERPRET"] = "0" if cuda else "1"
    try:
        out["kernels"] = {"ok": True, **_run_kernels("cuda" if cuda else "cpu")}
    except Exception as exc:
        out["kernels"] = {"ok": False, "error": one_line(exc)}
    return out


def _run_kernels(device: str) -> dict[str, Any]:
    """A pack+unpack reshard (TP 1 NHD blocks of 16 -> TP 2 HND blocks of 32) with the torch
    backend and with the Triton kernels, on `device`; the bytes must be the same."""
    import numpy as np
    import torch

    from kvxfer import allocate_kv_caches, reshard

    tokens = 40
    src, dst = _tiny_specs()
    src_caches = allocate_kv_caches(src, device=device)
    for t in src_caches:
        t.view(torch.int16).random_()
    src_ids = np.asarray([5, 2, 7], np.int64)
    dst_ids = np.asarray([3, 1], np.int64)
    out = {}
    began = time.perf_counter()
    for backend in ("torch", "triton"):
        ranks = dst.engine_ranks()
        caches = [[t.fill_(7) for t in allocate_kv_caches(s, device=device)] for s in ranks]
        reshard(
            [(src, src_caches, src_ids)],
            [(s, c, dst_ids) for s, c in zip(ranks, caches, strict=True)],
            tokens,
            strategy="pack+unpack",
            backend=backend,
        )
        out[backend] = caches
    if not _same(out["triton"], out["torch"]):
        raise RuntimeError("the Triton kernels moved different bytes than the torch backend")
    return {"seconds": round(time.perf_counter() - began, 3)}


def _same(got: list[list[Any]], want: list[list[Any]]) -> bool:
    """Bit-equal caches (compared as integers: random bits hold NaNs)."""
    import torch

    return all(
        torch.equal(a.view(torch.int16), b.view(torch.int16))
        for g, w in zip(got, want, strict=True)
        for a, b in zip(g, w, strict=True)
    )


def one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def _probe_vllm() -> dict[str, Any]:
    import kvxfer.integrations.vllm  # noqa: F401

    return {}


_PROBES = {"transfer": _probe_transfer, "device": _probe_device, "vllm": _probe_vllm}


def probe_main(kind: str) -> None:
    """Run one probe and print its outcome as the last line of stdout (JSON)."""
    try:
        out = {"ok": True, **_PROBES[kind]()}
    except BaseException as exc:  # report anything, including SystemExit from an import
        out = {"ok": False, "error": one_line(exc)}
    print(json.dumps(out), flush=True)
    os._exit(0)  # skip the engines' slow teardown


class Probe:
    """A probe running in a subprocess."""

    def __init__(self, kind: str, env: dict[str, str] | None = None) -> None:
        self.kind = kind
        self.began = time.monotonic()
        code = f"from kvxfer.cli.doctor_probes import probe_main; probe_main({kind!r})"
        child_env = dict(os.environ)
        child_env.setdefault("MC_LOG_LEVEL", "ERROR")
        child_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=child_env,
        )

    def result(self, timeout: float) -> dict[str, Any]:
        """The probe's outcome: {"ok": bool, "error": ..., facts...}."""
        left = max(1.0, timeout - (time.monotonic() - self.began))
        try:
            out, err = self.proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            return {"ok": False, "error": f"did not finish within {timeout:g} s", "timeout": True}
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if lines:
            try:
                return dict(json.loads(lines[-1]))
            except ValueError:
                pass
        tail = [line.strip() for line in err.splitlines() if line.strip()]
        why = tail[-1] if tail else "no output"
        return {"ok": False, "error": f"exit code {self.proc.returncode}: {why}"}
