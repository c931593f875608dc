"""Rows of kvxfer's feature table through real `vllm serve` engines (vLLM's CPU build): TP sizes
that do not divide each other, GQA models whose KV heads vLLM replicates, pipeline stages, MLA,
sliding-window and Mamba groups, bf16 weights and fp8 caches, a prefix the decode or the
prefill engine already holds, and a decode engine whose cache is so small that running
requests are preempted while loads are in flight (docs/engine-layouts.md has the table of
rows, and what the CPU build itself does).

Each class starts its model's engines once and sends every case of the class through them.
The engines of a class are `kv_both` (each a prefill engine for some routes and a decode
engine for others), so one pair of engines proves both directions of an asymmetry; every
route has its own kvxfer proxy. Each case makes the checks of `pd_checks.check_prompt`:
the greedy token ids of one engine alone (the class's baseline, TP 1, no connector), the
decode engine's `external_kv_transfer` tokens, no failed load, both engines idle afterwards.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from conftest import Pair, both_config, first_request, observe
from pd_checks import (
    LOCAL_CACHE_HIT,
    PREEMPTIONS,
    PROMPT_TOKENS_BY_SOURCE,
    WAITING_BY_REASON,
    check_in_flight,
    check_prompt,
    collect,
    external_tokens,
    prompt_ids,
    wait_idle,
)

from kvxfer.testing import vllm_driver as driver
from kvxfer.testing.vllm_cpu_engines import Processes, Server, free_port

# What every route sends: under a block, blocks and a part, over the prefill's chunk budget.
ROW_LENGTHS = (20, 209, 700)
# 16 requests in flight at once: mixed lengths, none a multiple of 32.
IN_FLIGHT_LENGTHS = (17, 33, 50, 70, 101, 130, 150, 190, 257, 300, 333, 411, 470, 590, 650, 777)


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """One engine of a class: TP size, block size, pipeline stages, command-line options and
    environment of its own."""

    tp: int
    block: int
    options: tuple[str, ...] = ()
    pp: int = 1
    env: tuple[tuple[str, str], ...] = ()

    @property
    def ranks(self) -> int:
        """Its workers: one kvxfer load each per request it decodes."""
        return self.tp * self.pp

    @property
    def argv(self) -> tuple[str, ...]:
        """Its own options. Pipeline stages run compiled: vLLM 0.32's CPU runner creates the
        buffer a later stage receives its input in only in its warm-up, which eager mode skips
        (`--enforce-eager` with `--pipeline-parallel-size 2` dies on the first request:
        `assert self.intermediate_tensors is not None`, gpu_model_runner.py)."""
        if self.pp == 1:
            return self.options
        return ("--pipeline-parallel-size", str(self.pp), "--no-enforce-eager", *self.options)


class Rig:
    """A class's engines by name, its baseline engine and a proxied pair per route."""

    def __init__(self, engines: dict[str, Server], shapes: dict[str, EngineShape]) -> None:
        self.engines = engines
        self.shapes = shapes
        self.pairs: dict[tuple[str, str], Pair] = {}
        self._expected: dict[tuple[str, tuple[int, ...]], dict[str, Any]] = {}
        self.baseline: Server | None = None

    def expected(self, prompt: list[int], engine: str | None = None) -> dict[str, Any]:
        """The result for `prompt` alone of the baseline, or of the class's `engine` asked
        directly (no transfer: one engine alone); asked once per prompt and engine."""
        server = self.engines[engine] if engine else self.baseline
        assert server is not None
        key = (server.name, tuple(prompt))
        if key not in self._expected:
            self._expected[key] = collect(server.url, [prompt])
        return self._expected[key]


def start_rig(
    processes: Processes,
    model: Path,
    secret: str,
    label: str,
    shapes: dict[str, EngineShape],
    routes: tuple[tuple[str, str], ...],
    baseline: Server | None,
    baseline_options: tuple[str, ...] = (),
) -> Rig:
    """Start a class's engines (and its baseline engine when `baseline` is None) at once, then
    a proxy per route and one request through each route (the first connect)."""
    started = time.monotonic()
    engines = {
        name: processes.start_engine(
            f"{label}-{name}",
            model,
            tensor_parallel_size=shape.tp,
            block_size=shape.block,
            kv_transfer_config=both_config(f"{label}-{name}", secret, free_port()),
            options=shape.argv,
            env=dict(shape.env),
        )
        for name, shape in shapes.items()
    }
    own_baseline = baseline is None
    if own_baseline:
        baseline = processes.start_engine(
            f"{label}-baseline", model, tensor_parallel_size=1, block_size=32,
            options=baseline_options,
        )  # fmt: skip
    rig = Rig(engines, shapes)
    rig.baseline = baseline
    try:
        processes.wait_ready([*engines.values(), *([baseline] if own_baseline else [])])
        observe(event="engines started", pair=label, seconds=round(time.monotonic() - started, 1))
        for prefill, decode in routes:
            proxy = processes.start_proxy(engines[prefill], engines[decode])
            name = f"{label}:{prefill}>{decode}"
            pair = Pair(engines[prefill], engines[decode], proxy, shapes[decode].ranks, name)
            rig.pairs[(prefill, decode)] = pair
            first_request(proxy, engines[decode], pair.label)
            wait_idle([pair.prefill, pair.decode])
    except BaseException:
        # The class's fixture never yields, so its teardown never stops them: their memory
        # would stay taken while later classes start theirs (the OOM killer then took
        # their workers).
        stop_rig(processes, rig, own_baseline)
        raise
    return rig


def stop_rig(processes: Processes, rig: Rig, own_baseline: bool) -> None:
    """Stop a class's engines, proxies and (when it started one) its baseline engine."""
    servers = [*rig.engines.values(), *(p.proxy for p in rig.pairs.values())]
    if own_baseline and rig.baseline is not None:
        servers.append(rig.baseline)
    processes.stop(servers)


def route_id(route: tuple[str, str], shapes: dict[str, EngineShape]) -> str:
    """A route's test id: its engines' names and block sizes, e.g. `tp2-b64-to-tp3-b96`."""
    return "-to-".join(f"{name}-b{shapes[name].block}" for name in route)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A class's `route_case`s: every `ROW_LENGTHS` prompt over every route of its `ROUTES`."""
    if "route_case" in metafunc.fixturenames and metafunc.cls is not None:
        cls = metafunc.cls
        metafunc.parametrize(
            "route_case",
            [
                pytest.param((route, n), id=f"{route_id(route, cls.ENGINES)}-{n}-tokens")
                for route in cls.ROUTES
                for n in ROW_LENGTHS
            ],
        )


@pytest.fixture(scope="class")
def rig(
    request: pytest.FixtureRequest,
    processes: Processes,
    model_of: Callable[[str], Path],
    secret: str,
) -> Iterator[Rig]:
    """The class's engines (`ENGINES` of its `MODEL`), started once for the class and stopped
    after it, with a baseline engine of the same model (the session's, for the default model)."""
    cls = request.cls
    baseline = request.getfixturevalue("baseline") if cls.MODEL == "kv4" else None
    rig = start_rig(
        processes,
        model_of(cls.MODEL),
        secret,
        cls.LABEL,
        cls.ENGINES,
        cls.ROUTES,
        baseline,
        getattr(cls, "BASELINE_OPTIONS", ()),
    )
    yield rig
    stop_rig(processes, rig, own_baseline=baseline is None)


class RouteCases:
    """Every `ROW_LENGTHS` prompt over every route of a class."""

    MODEL: str
    LABEL: str
    ENGINES: ClassVar[dict[str, EngineShape]]
    ROUTES: tuple[tuple[str, str], ...]
    # A route's reference engine, where it is not the baseline (an engine of the class asked
    # directly), and the routes whose token match is reported, not asserted.
    REFERENCES: ClassVar[dict[tuple[str, str], str]] = {}
    REPORTED_ONLY: tuple[tuple[str, str], ...] = ()
    # Options of the class's own baseline engine (TP 1, blocks of 32, no connector).
    BASELINE_OPTIONS: tuple[str, ...] = ()

    def test_greedy_tokens_equal_one_engine_alone(
        self, rig: Rig, vocab: int, route_case: tuple[tuple[str, str], int]
    ) -> None:
        """The prompt's greedy token ids are the reference's, its KV loaded through kvxfer."""
        route, length = route_case
        prompt = prompt_ids(length, vocab, salt=self.MODEL)
        expected = rig.expected(prompt, self.REFERENCES.get(route))
        check_prompt(
            rig.pairs[route],
            expected,
            f"{length}-tokens",
            loads=self.loaded_tokens(length),
            compare_tokens=route not in self.REPORTED_ONLY,
        )

    def loaded_tokens(self, prompt_tokens: int) -> int:
        """The prompt tokens whose KV the decode engine loads (`external_tokens`)."""
        return external_tokens(prompt_tokens)


class InFlightCases(RouteCases):
    """`RouteCases`, and `IN_FLIGHT_LENGTHS` in flight at once over the class's
    `IN_FLIGHT_ROUTE`."""

    IN_FLIGHT_ROUTE: tuple[str, str]

    def test_sixteen_requests_in_flight_at_once(self, rig: Rig, vocab: int) -> None:
        """16 requests of mixed lengths in flight at once (`check_in_flight`)."""
        prompts = [prompt_ids(n, vocab, salt=f"{self.MODEL}-16") for n in IN_FLIGHT_LENGTHS]
        assert rig.baseline is not None
        route = self.IN_FLIGHT_ROUTE
        check_in_flight(
            rig.pairs[route],
            rig.baseline,
            prompts,
            "16-in-flight",
            compare_tokens=route not in self.REPORTED_ONLY,
            loads=self.loaded_tokens,
        )


class TestTpSizesThatDoNotDivide(InFlightCases):
    """6 KV heads: prefill TP 2 (3 heads a rank, blocks of 64) <-> decode TP 3 (2 heads a rank,
    blocks of 96): neither TP size nor block size divides the other, so every decode rank
    reads from both prefill ranks and no block maps onto a whole block."""

    MODEL = "kv6"
    LABEL = "kv6"
    ENGINES: ClassVar[dict[str, EngineShape]] = {
        "tp2": EngineShape(2, 64),
        "tp3": EngineShape(3, 96),
    }
    ROUTES = (("tp2", "tp3"), ("tp3", "tp2"))
    IN_FLIGHT_ROUTE = ("tp2", "tp3")


GQA_ENGINES = {
    "tp1": EngineShape(1, 32),
    "tp2": EngineShape(2, 64),
    "tp2-small": EngineShape(2, 32),
}
GQA_ROUTES = (("tp1", "tp2"), ("tp2", "tp1"), ("tp2-small", "tp2"))


class TestGqaOneKvHeadReplicated(InFlightCases):
    """1 KV head for 4 query heads: at TP 2 vLLM keeps the one KV head on both ranks. TP 1 -> 2
    (each decode rank's copy from the one prefill rank), 2 -> 1 (one of the two replicas is
    read), 2 -> 2 with blocks of 32 -> 64."""

    MODEL = "kv1"
    LABEL = "kv1"
    ENGINES = GQA_ENGINES
    ROUTES = GQA_ROUTES
    IN_FLIGHT_ROUTE = ("tp1", "tp2")


class TestGqaTwoKvHeads(InFlightCases):
    """2 KV heads for 4 query heads, at TP 1 and TP 2 (one KV head a rank): the same routes."""

    MODEL = "kv2"
    LABEL = "kv2"
    ENGINES = GQA_ENGINES
    ROUTES = GQA_ROUTES
    IN_FLIGHT_ROUTE = ("tp2", "tp1")


# The shared prefix of the prefix-cache cases: about 1,000 tokens, 15 blocks of 64 (the
# decode's) and 31 of 32 (the prefill's) whole.
PREFIX_TOKENS = 1000
# The small decode cache: 48 blocks of 32 tokens for 16 requests of 17-777 tokens (4,529 in
# all) that decode `PREEMPTING_TOKENS` more each, so running requests outgrow it and are
# preempted (with 32 more each, none was: arrivals are staggered by the prefill); its model
# length fits the 47 blocks vLLM hands out (one is its null block).
SMALL_CACHE = ("--num-gpu-blocks-override", "48", "--max-model-len", "1504")
PREEMPTING_TOKENS = 200


class TestDecodeCacheStates:
    """The default model (4 KV heads), prefix caching on in every engine: a prefill engine (TP
    1, blocks of 32), a decode engine (TP 2, blocks of 64) and a decode engine whose cache
    holds 64 blocks of 32 tokens (TP 1)."""

    MODEL = "kv4"
    LABEL = "cache-states"
    ENGINES: ClassVar[dict[str, EngineShape]] = {
        "prefill": EngineShape(1, 32, ("--enable-prefix-caching",)),
        "decode": EngineShape(2, 64, ("--enable-prefix-caching",)),
        "small": EngineShape(1, 32, ("--enable-prefix-caching", *SMALL_CACHE)),
    }
    ROUTES = (("prefill", "decode"), ("prefill", "small"))

    def test_a_decode_prefix_hit_loads_only_what_the_decode_lacks(
        self, rig: Rig, vocab: int
    ) -> None:
        """Two requests share a 1,000-token prefix: the first loads its whole prompt; the
        second finds the prefix's 15 whole blocks of 64 in the decode engine's own cache and
        loads only the tokens after them, and the bytes it moves are in that proportion."""
        pair = rig.pairs[("prefill", "decode")]
        prefix = prompt_ids(PREFIX_TOKENS, vocab, salt="decode-prefix")
        first = prefix + prompt_ids(40, vocab, salt="decode-prefix-a")
        second = prefix + prompt_ids(57, vocab, salt="decode-prefix-b")
        whole = check_prompt(pair, rig.expected(first), "decode-prefix-first")
        block = rig.shapes["decode"].block
        held = PREFIX_TOKENS // block * block
        lacked = len(second) - held
        part = check_prompt(pair, rig.expected(second), "decode-prefix-hit", loads=lacked)
        assert part["decode_local_hits"] == held
        per_token = whole["kvxfer_bytes"] / len(first)
        assert part["kvxfer_bytes"] == per_token * lacked, (whole, part)

    def test_a_prefill_prefix_hit_still_hands_over_the_whole_prompt(
        self, rig: Rig, vocab: int
    ) -> None:
        """The prefill engine holds a 1,000-token prefix (a request of its own, no transfer),
        the decode engine does not: a request sharing it is computed from the prefill's cache
        there, and the decode engine loads the whole prompt."""
        pair = rig.pairs[("prefill", "decode")]
        prefix = prompt_ids(PREFIX_TOKENS, vocab, salt="prefill-prefix")
        collect(pair.prefill.url, [prefix + prompt_ids(30, vocab, salt="prefill-prefix-a")])
        hits_before = pair.prefill.metric(PROMPT_TOKENS_BY_SOURCE, LOCAL_CACHE_HIT)
        prompt = prefix + prompt_ids(61, vocab, salt="prefill-prefix-b")
        check_prompt(pair, rig.expected(prompt), "prefill-prefix-hit")
        hits = pair.prefill.metric(PROMPT_TOKENS_BY_SOURCE, LOCAL_CACHE_HIT) - hits_before
        block = rig.shapes["prefill"].block
        assert hits == PREFIX_TOKENS // block * block, "the prefill engine missed its prefix"

    def test_preempted_requests_are_recomputed_while_loads_are_in_flight(
        self, rig: Rig, vocab: int
    ) -> None:
        """16 requests at once into the small decode cache, 200 tokens generated each (the cache
        holds a third of what they need): vLLM preempts running requests
        (they are recomputed there: their KV was loaded once) while others wait for their
        loads. Every output equals the baseline's where batching does not change it, no load
        fails, no request is left waiting for remote KV and every block is free afterwards."""
        pair = rig.pairs[("prefill", "small")]
        preempted_before = pair.decode.metric(PREEMPTIONS)
        prompts = [prompt_ids(n, vocab, salt="preempt") for n in IN_FLIGHT_LENGTHS]
        assert rig.baseline is not None
        check_in_flight(
            pair, rig.baseline, prompts, "16-in-flight-preempted", max_tokens=PREEMPTING_TOKENS
        )
        preempted = pair.decode.metric(PREEMPTIONS) - preempted_before
        observe(pair=pair.label, case="preemptions", preempted=preempted)
        assert preempted >= 1, "no request was preempted: the case proves nothing"
        assert pair.decode.metric(WAITING_BY_REASON, 'reason="deferred"') == 0


# On CPUs with AMX tiles vLLM's CPU build picks AMX_MLA for MLA models unless told otherwise,
# which fails to start with float32 weights ("expect weight to be bfloat16, float16, int8,
# fp8_e4m3 or uint8", without kvxfer) and whose layout kvxfer refuses (unverified):
# the class asks for CPU MLA on every machine.
CPU_MLA = ("--attention-backend", "CPU_MLA")


class TestMlaLatentCache(InFlightCases):
    """A DeepSeek-V2-style model (a 512 + 64 latent, the only one vLLM's CPU MLA backend
    serves) at TP 1 <-> TP 2: the latent is the same on every rank, so each decode rank reads
    it from one prefill rank. vLLM's CPU build forces blocks of 16 for MLA on both engines
    (`platforms/cpu.py`: "CPU MLA backend requires block_size=16"), so no block-size change
    can run here; the probe moves CPU MLA's cache to and from blocks of 64.

    Token matches are reported, not asserted: the CPU build's MLA gives other greedy tokens
    with the engine's own TP size and batch (measured, one engine alone, no connector: 0 of 5
    prompts the same at TP 1 and TP 2, 0 of 5 one at a time and 5 at once, the first token
    unlike transformers' where its top-two margin is 1.28; docs/engine-layouts.md). What is
    asserted: every prompt token's latent loaded, exactly its bytes, no failed load, no block
    held afterwards."""

    MODEL = "mla"
    LABEL = "mla"
    ENGINES: ClassVar[dict[str, EngineShape]] = {
        "tp1": EngineShape(1, 16, CPU_MLA),
        "tp2": EngineShape(2, 16, CPU_MLA),
    }
    BASELINE_OPTIONS = CPU_MLA
    ROUTES = (("tp1", "tp2"), ("tp2", "tp1"))
    IN_FLIGHT_ROUTE = ("tp1", "tp2")
    REPORTED_ONLY = ROUTES

    def test_each_decode_rank_loads_the_whole_latent(self, rig: Rig, vocab: int) -> None:
        """209 tokens TP 1 -> TP 2: both decode ranks load every token's 576-element latent of
        both layers (float32), and nothing more."""
        pair = rig.pairs[("tp1", "tp2")]
        prompt = prompt_ids(209, vocab, salt="latent-bytes")
        seen = check_prompt(pair, rig.expected(prompt), "209-tokens-bytes", compare_tokens=False)
        assert seen["kvxfer_bytes"] == 2 * len(prompt) * 2 * 576 * 4, seen


# The sliding-window model's window (kvxfer/testing/tiny_model.py) and its layers of each kind.
WINDOW, WINDOWED_LAYERS, FULL_LAYERS = 64, 2, 2


class TestSlidingWindowGroups(InFlightCases):
    """A Gemma 3 model whose layers 0 and 2 attend to a window of 64 tokens and 1 and 3 to
    everything: vLLM's hybrid allocator keeps two KV cache groups, each with its own block
    table; kvxfer moves each with a producer and consumer of its own, the windowed one only
    the last `WINDOW` tokens the recomputed last prompt token attends to."""

    MODEL = "sliding"
    LABEL = "sliding"
    ENGINES: ClassVar[dict[str, EngineShape]] = {
        "tp1": EngineShape(1, 32),
        "tp2": EngineShape(2, 64),
    }
    ROUTES = (("tp1", "tp2"), ("tp2", "tp1"))
    IN_FLIGHT_ROUTE = ("tp1", "tp2")

    def test_a_windowed_group_moves_only_its_window(self, rig: Rig, vocab: int) -> None:
        """A prompt of 700 tokens, ten windows: the full layers move every token, the windowed
        layers the last 64 (those the recomputed last prompt token attends to; its window's
        first token, 636, shares a block of 64 with 637, the first vLLM keeps); bytes exactly
        so (4 KV heads of 32 float32 elements, K and V)."""
        pair = rig.pairs[("tp1", "tp2")]
        prompt = prompt_ids(700, vocab, salt="window")
        seen = check_prompt(pair, rig.expected(prompt), "700-tokens-window")
        cell = 2 * 4 * 32 * 4  # K and V of every head, one token and layer
        expected = cell * (FULL_LAYERS * len(prompt) + WINDOWED_LAYERS * WINDOW)
        assert seen["kvxfer_bytes"] == expected, seen


PP_ENGINES: dict[str, EngineShape] = {
    "pp2": EngineShape(1, 32, pp=2),
    "pp2-3+1": EngineShape(1, 32, pp=2, env=(("VLLM_PP_LAYER_PARTITION", "3,1"),)),
    "tp2": EngineShape(2, 64),
    "tp1": EngineShape(1, 32),
}


class TestPipelineStages(RouteCases):
    """A 4-layer model: prefill PP 2 (2 + 2 layers) -> decode TP 2, prefill PP 2 split 3 + 1
    (`VLLM_PP_LAYER_PARTITION`) -> decode TP 2, and prefill TP 1 -> decode PP 2: each decode
    worker fetches its own layers and heads from the prefill worker that holds them."""

    MODEL = "kv4-4layers"
    LABEL = "pp"
    ENGINES = PP_ENGINES
    ROUTES = (("pp2", "tp2"), ("pp2-3+1", "tp2"), ("tp1", "pp2"))


BF16 = ("--dtype", "bfloat16")


class TestDtypes(RouteCases):
    """bf16 weights (vLLM CPU attention's `vec` path; on CPUs with AMX tiles its `amx` path,
    blocks of 32 and 64 being multiples of 32), and fp8 caches: bf16 TP 1 <-> TP 2; a bf16
    prefill -> an fp8 (e4m3) decode, whose cache then holds what its own write makes of the
    prefill's K and V (the probe, test_cpu_attention_layout.py); an fp8 (e5m2) prefill -> a
    bf16 decode. The fp8 routes' reference is one engine with the decode's cache dtype (the
    decode engine asked directly); their token match is reported, not asserted (an fp8 cache
    quantizes what the decode would have computed, so its outputs may part from it)."""

    MODEL = "kv4"
    LABEL = "dtypes"
    ENGINES: ClassVar[dict[str, EngineShape]] = {
        "bf16": EngineShape(1, 32, BF16),
        "bf16-tp2": EngineShape(2, 64, BF16),
        "e4m3": EngineShape(1, 32, (*BF16, "--kv-cache-dtype", "fp8_e4m3")),
        "e5m2": EngineShape(1, 64, (*BF16, "--kv-cache-dtype", "fp8_e5m2")),
    }
    ROUTES = (("bf16", "bf16-tp2"), ("bf16-tp2", "bf16"), ("bf16", "e4m3"), ("e5m2", "bf16"))
    REFERENCES: ClassVar[dict[tuple[str, str], str]] = {
        ("bf16", "bf16-tp2"): "bf16",
        ("bf16-tp2", "bf16"): "bf16",
        ("bf16", "e4m3"): "e4m3",
        ("e5m2", "bf16"): "bf16",
    }
    REPORTED_ONLY = (("bf16", "e4m3"), ("e5m2", "bf16"))


class TestMambaHybrid(InFlightCases):
    """A Granite 4-style hybrid: a Mamba2 mixer (8 heads of 32, 2 groups) then attention, TP 1
    <-> TP 2: vLLM keeps a Mamba group (the conv and SSM states, one block a request) and an
    attention group; kvxfer reshards each state's sub-projections over TP. As vLLM's own
    connectors do, the prefill computes the prompt but its last token and hands over the state
    after it; the decode loads those tokens and computes the last. Both engines store the conv
    state channels first (`VLLM_SSM_CONV_STATE_LAYOUT=DS`, which kvxfer's heterogeneous-TP
    state transfer requires, as vLLM's does); prefix caching stays off (the CPU build's Mamba
    'align' mode, which it turns on, dies on prompts over a block: docs/engine-layouts.md)."""

    MODEL = "hybrid"
    LABEL = "hybrid"
    ENGINES: ClassVar[dict[str, EngineShape]] = {
        "tp1": EngineShape(1, 32, env=(("VLLM_SSM_CONV_STATE_LAYOUT", "DS"),)),
        "tp2": EngineShape(2, 64, env=(("VLLM_SSM_CONV_STATE_LAYOUT", "DS"),)),
    }
    ROUTES = (("tp1", "tp2"), ("tp2", "tp1"))
    IN_FLIGHT_ROUTE = ("tp1", "tp2")

    def loaded_tokens(self, prompt_tokens: int) -> int:
        """All but the last prompt token (the state after them is what moves)."""
        return external_tokens(prompt_tokens - 1)


AMX_TILES = torch.cpu._is_amx_tile_supported()


@pytest.mark.skipif(
    not AMX_TILES,
    reason="vLLM CPU attention's amx ISA needs a CPU with AMX tiles "
    "(torch.cpu._is_amx_tile_supported()); this one has none",
)
class TestAmxTiles(RouteCases):
    """bf16 caches in blocks of 32s on a CPU with AMX tiles: vLLM CPU attention's `amx` ISA and
    its tile layout (`amx_tiles`), TP 1 <-> TP 2; and AMX on one side with a float32 engine
    (ISA `vec`) on the other, converted between bf16 and float32 on the way (token match
    reported: the two engines round differently). The layout itself is probed through the op
    on any x86 CPU (test_cpu_attention_layout.py)."""

    MODEL = "kv4"
    LABEL = "amx"
    ENGINES: ClassVar[dict[str, EngineShape]] = {
        "amx": EngineShape(1, 32, BF16),
        "amx-tp2": EngineShape(2, 64, BF16),
        "vec-fp32": EngineShape(2, 64),
    }
    ROUTES = (("amx", "amx-tp2"), ("amx-tp2", "amx"), ("amx", "vec-fp32"), ("vec-fp32", "amx"))
    REFERENCES: ClassVar[dict[tuple[str, str], str]] = {
        ("amx", "amx-tp2"): "amx",
        ("amx-tp2", "amx"): "amx",
        ("amx", "vec-fp32"): "vec-fp32",
        ("vec-fp32", "amx"): "amx",
    }
    REPORTED_ONLY = (("amx", "vec-fp32"), ("vec-fp32", "amx"))

    @pytest.fixture(scope="class", autouse=True)
    def bf16_engine_serves(self, processes: Processes, tiny_model: Path) -> None:
        """One bf16 engine alone, no connector, answers a request, or the class skips naming
        what the engine said: vLLM's CPU build itself lost a bf16 engine's worker on its first
        request on an AMX machine before (docs/engine-layouts.md)."""
        engine = processes.start_engine("amx-alone", tiny_model, tensor_parallel_size=1,
                                        block_size=32, options=BF16)  # fmt: skip
        try:
            processes.wait_ready([engine])
            collect(engine.url, [list(range(3, 43))])
        except driver.E2EError as exc:  # the engine's own failure, without kvxfer
            pytest.skip(f"vLLM's CPU build cannot serve bf16 with the amx ISA here: {exc}")
        finally:
            processes.stop([engine])
