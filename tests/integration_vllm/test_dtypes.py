"""A bf16 prefill engine feeding an fp8 decode engine, and an fp8 prefill engine feeding a bf16
one, under vLLM's Scheduler with kvxfer's connector on both sides (TP 1 -> TP 2, blocks of 16 ->
32, layouts LBNHC -> LBHNC; test_pd_flow.py covers TP sizes that do not divide). The fp8
engines' caches are vLLM's uint8 tensors, their attention layers carry calibrated scales (a
distinct k_scale and v_scale per layer), which the workers read into their specs: the engines
pair at the handshake and kvxfer's kernels convert. The decode engine must hold, before it
computes anything, the bytes its own cache write would have made from the model's K and V
(bf16 -> fp8: vLLM's quantization with its scales), or the prefill's fp8 values dequantized
with the prefill's scales (fp8 -> bf16)."""

from __future__ import annotations

import pytest
from pd_engines import (
    Engine,
    EngineSpec,
    load_and_check,
    prefill_remote,
    random_prompt,
    running,
    write_model,
)

from kvxfer.addresses import free_port_run

COMMON = {"cost_model": "tcp_loopback"}
TIMEOUT_S = 120.0


def _pair(model: str, name: str, prefill_dtype: str, decode_dtype: str) -> list[Engine]:
    port = free_port_run(1)
    prefill = EngineSpec(
        f"{name}-prefill", 1, 16, "kv_producer", 64, "LBNHC",
        {**COMMON, "side_channel_port": port}, cache_dtype=prefill_dtype, kv_from=prefill_dtype,
    )  # fmt: skip
    decode = EngineSpec(
        f"{name}-decode", 2, 32, "kv_consumer", 48, "LBHNC", dict(COMMON),
        cache_dtype=decode_dtype, kv_from=prefill_dtype,
    )  # fmt: skip
    return [Engine(model, prefill), Engine(model, decode)]


@pytest.mark.parametrize(
    ("prefill_dtype", "decode_dtype"),
    [("auto", "fp8"), ("fp8_e5m2", "auto")],
    ids=["bf16-to-fp8_e4m3", "fp8_e5m2-to-bf16"],
)
def test_engines_of_other_kv_dtypes_pair_and_the_decode_holds_its_own_bytes(
    tmp_path, prefill_dtype, decode_dtype
):
    model = write_model(tmp_path)
    name = f"{prefill_dtype}-{decode_dtype}".replace("_", "")
    with running(_pair(model, name, prefill_dtype, decode_dtype)) as (prefill, decode):
        prompts = {f"req-{n}": random_prompt(40 + n, length) for n, length in enumerate((45, 100))}
        params = prefill_remote(prefill, prompts, TIMEOUT_S)
        loads = {rid: (prompt, params[rid]) for rid, prompt in prompts.items()}
        seen = load_and_check(decode, [prefill], loads, TIMEOUT_S)
        for request_id, per_worker in seen.checked.items():
            assert per_worker == [[], []], f"{request_id}: mismatched positions {per_worker}"
        # The KV came over the wire: vLLM scheduled only the last prompt token to compute.
        assert all(seen.first_compute[rid] == 1 for rid in prompts), seen.first_compute
        assert not decode.invalid_block_ids
