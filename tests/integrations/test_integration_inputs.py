"""What a serving engine hands kvxfer, read without the engine installed: per-layer cache tensors in
an attention backend's logical shape (kv_tensors) and the connector's extra config (settings)."""

from __future__ import annotations

import pytest
import torch

from kvxfer.integrations.kv_tensors import EngineGeometry, spec_from_layers
from kvxfer.integrations.settings import ConnectorSettings
from kvxfer.kernels import canonical_kv_view
from kvxfer.plan import CostModel

GEOMETRY = EngineGeometry(total_kv_heads=8, head_dim=16, block_size=4, tp_size=2, tp_rank=1)
BLOCKS, HEADS = 6, 4  # heads per rank


def _layer(logical_placement: str, physical: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(physical allocation, its view in the backend's logical shape)."""
    sizes = {"kv": 2, "block": BLOCKS, "slot": 4, "head": HEADS, "dim": 16}
    logical = (
        ("kv", "block", "slot", "head", "dim")
        if logical_placement == "kv_first"
        else ("block", "kv", "slot", "head", "dim")
    )
    memory = torch.empty([sizes[r] for r in physical], dtype=torch.bfloat16)
    return memory, memory.permute([physical.index(r) for r in logical])


@pytest.mark.parametrize("logical_placement", ["kv_first", "blocks_first"])
@pytest.mark.parametrize(
    ("physical", "layout", "placement"),
    [
        (("kv", "block", "slot", "head", "dim"), "NHD", "kv_first"),
        (("kv", "block", "head", "slot", "dim"), "HND", "kv_first"),
        (("block", "kv", "slot", "head", "dim"), "NHD", "blocks_first"),
        (("block", "kv", "head", "slot", "dim"), "HND", "blocks_first"),
    ],
)
def test_layout_is_read_from_strides_whatever_the_logical_shape(
    logical_placement, physical, layout, placement
):
    layers = [_layer(logical_placement, physical) for _ in range(3)]
    spec, views = spec_from_layers([logical for _, logical in layers], GEOMETRY)
    assert (spec.layout, spec.kv_placement, spec.mla) == (layout, placement, False)
    assert (spec.num_layers, spec.num_blocks, spec.num_kv_heads) == (3, BLOCKS, 8)
    assert (spec.tp_size, spec.tp_rank, spec.block_size, spec.dtype) == (2, 1, 4, "bfloat16")
    for (memory, _), view in zip(layers, views, strict=True):
        # The very memory the engine allocated, in the contract's shape.
        assert view.data_ptr() == memory.data_ptr() and view.shape == memory.shape
        assert tuple(view.shape) == spec.layer_shape and view.is_contiguous()


@pytest.mark.parametrize(
    ("vllm_layout", "physical", "layout"),
    [("LBNHC", (0, 2, 1, 3), "NHD"), ("LBHNC", (0, 1, 2, 3), "HND")],
)
def test_vllm_bhnc_views_are_kv_inner(vllm_layout, physical, layout):
    """vLLM 0.33 registers `[B, H, N, 2 * head_dim]` views of a layer-compact allocation."""
    logical_shape = (BLOCKS, HEADS, 4, 32)
    memory = torch.empty([logical_shape[a] for a in physical], dtype=torch.bfloat16)
    logical = memory.permute([physical.index(a) for a in range(4)])
    spec, (view,) = spec_from_layers([logical], GEOMETRY)
    assert (spec.layout, spec.kv_placement, spec.num_blocks) == (layout, "kv_inner", BLOCKS)
    assert view.data_ptr() == memory.data_ptr() and tuple(view.shape) == spec.layer_shape
    # K is the first half of a cell, V the second: what the engine writes is what kvxfer reads.
    bits = torch.arange(logical.numel(), dtype=torch.int16).view(logical_shape)
    logical.view(torch.int16).copy_(bits)
    cells = canonical_kv_view(view, spec.layout, spec.kv_placement, spec.mla).view(torch.int16)
    for plane in (0, 1):  # canonical [plane, block, slot, head, dim] vs logical [B, H, N, C]
        expected = bits[..., plane * 16 : (plane + 1) * 16].permute(0, 2, 1, 3)
        assert torch.equal(cells[plane], expected)


def test_mla_latent_cache():
    geometry = EngineGeometry(1, 576, 16, tp_size=4, tp_rank=3, mla=True)
    layers = [torch.empty(10, 16, 576, dtype=torch.float16) for _ in range(2)]
    spec, views = spec_from_layers(layers, geometry)
    assert spec.mla and spec.num_blocks == 10 and spec.head_dim == 576
    assert [v.data_ptr() for v in views] == [t.data_ptr() for t in layers]
    vllm_views = [t.unsqueeze(1) for t in layers]  # vLLM 0.33: [B, 1, N, latent]
    assert spec_from_layers(vllm_views, geometry)[0] == spec


def test_bad_tensors_get_errors_that_say_what_is_wrong():
    _, good = _layer("kv_first", ("kv", "block", "slot", "head", "dim"))
    with pytest.raises(ValueError, match="block_size, heads per rank, head_dim"):
        spec_from_layers([good], EngineGeometry(8, 16, 8, tp_size=2, tp_rank=0))
    with pytest.raises(ValueError, match="memory order"):
        _, odd = _layer("kv_first", ("dim", "kv", "block", "slot", "head"))
        spec_from_layers([odd], GEOMETRY)
    with pytest.raises(ValueError, match="not dense"):
        wide = torch.empty(2, BLOCKS * 2, 4, HEADS, 16, dtype=torch.bfloat16)
        spec_from_layers([wide[:, ::2]], GEOMETRY)
    with pytest.raises(ValueError, match="layers differ"):
        _, hnd = _layer("kv_first", ("kv", "block", "head", "slot", "dim"))
        spec_from_layers([good, hnd], GEOMETRY)
    with pytest.raises(ValueError, match="no KV cache tensors"):
        spec_from_layers([], GEOMETRY)
    # vLLM's heads-outermost (LHBNC) and block-outermost (BLNHC) layouts: the fix is named.
    heads_outer = torch.empty(HEADS, BLOCKS, 4, 32, dtype=torch.bfloat16).permute(1, 0, 2, 3)
    with pytest.raises(ValueError, match=r"memory order.*VLLM_KV_CACHE_LAYOUT=LBNHC"):
        spec_from_layers([heads_outer], GEOMETRY)
    two_layers = torch.empty(BLOCKS, 2, 4, HEADS, 32, dtype=torch.bfloat16)
    layer_of_block = two_layers[:, 0].permute(0, 2, 1, 3)
    with pytest.raises(ValueError, match=r"not dense.*VLLM_KV_CACHE_LAYOUT=LBNHC"):
        spec_from_layers([layer_of_block], GEOMETRY)


def _stage(pp_rank: int, pp_size: int = 2, kv_layers: tuple[int, ...] = tuple(range(5))):
    return EngineGeometry(
        8, 16, 4, tp_size=2, tp_rank=1, pp_size=pp_size, pp_rank=pp_rank, kv_layers=kv_layers
    )


def test_a_pipeline_stage_is_placed_by_its_layer_names():
    """vLLM registers a stage's caches by name (`model.layers.N...`): the spec counts the
    stage's layers from their indices, in layer order whatever order they come in."""
    layers = {i: _layer("kv_first", ("kv", "block", "slot", "head", "dim"))[1] for i in (4, 3)}
    spec, views = spec_from_layers(list(layers.values()), _stage(1), list(layers))
    assert (spec.pp_size, spec.pp_rank, spec.tp_rank) == (2, 1, 1)
    assert (spec.layer_start, spec.num_layers, spec.total_layers) == (3, 2, 5)
    assert [v.data_ptr() for v in views] == [layers[3].data_ptr(), layers[4].data_ptr()]
    first, _ = spec_from_layers([layers[3]] * 3, _stage(0), [2, 0, 1])
    assert (first.layer_start, first.num_layers, first.layers) == (0, 3, range(0, 3))
    assert first.engine_ranks()[2:] == [spec.with_rank(0), spec]  # vLLM's default split
    # Without pipeline parallelism, names only order the layers.
    whole, ordered = spec_from_layers([layers[4], layers[3]], GEOMETRY, [1, 0])
    assert (whole.pp_size, whole.layer_start, whole.total_layers, whole.num_layers) == (1, 0, 0, 2)
    assert [v.data_ptr() for v in ordered] == [layers[3].data_ptr(), layers[4].data_ptr()]


def test_stages_count_in_kv_cache_layer_space():
    """Layers 2 and 5 hold no KV cache (no-op attention): a layer's index is its place among
    the layers that do, on every engine, so stages of any split agree on which cache is
    which."""
    kv_layers = (0, 1, 3, 4, 6)
    _, layer = _layer("kv_first", ("kv", "block", "slot", "head", "dim"))
    first, _ = spec_from_layers([layer] * 2, _stage(0, kv_layers=kv_layers), [0, 1])
    last, _ = spec_from_layers([layer] * 3, _stage(1, kv_layers=kv_layers), [6, 3, 4])
    assert (first.layer_start, first.num_layers, first.total_layers) == (0, 2, 5)
    assert (last.layer_start, last.num_layers, last.total_layers) == (2, 3, 5)


def test_pipeline_stage_errors_name_what_is_wrong():
    _, layer = _layer("kv_first", ("kv", "block", "slot", "head", "dim"))
    with pytest.raises(ValueError, match=r"kv_layers: required with pp_size 2"):
        EngineGeometry(8, 16, 4, tp_size=2, tp_rank=1, pp_size=2, pp_rank=1)
    with pytest.raises(ValueError, match="pp_rank 2 of pp_size 2"):
        _stage(2)
    with pytest.raises(ValueError, match="distinct non-negative model-layer indices"):
        _stage(0, kv_layers=(1, 0))
    with pytest.raises(ValueError, match=r"pass each cache tensor's model-layer index"):
        spec_from_layers([layer], _stage(1))
    with pytest.raises(ValueError, match=r"2 indices for 1 cache tensors"):
        spec_from_layers([layer], _stage(1), [3, 4])
    with pytest.raises(ValueError, match=r"model layers \[3\] have more than one cache tensor"):
        spec_from_layers([layer] * 2, _stage(1), [3, 3])
    with pytest.raises(ValueError, match=r"skip model layers \[3\]"):
        spec_from_layers([layer] * 2, _stage(1), [2, 4])
    with pytest.raises(ValueError, match=r"model layers \[7\] hold no KV cache"):
        spec_from_layers([layer] * 2, _stage(1), [4, 7])
    # The spec's own checks: the last stage ends at the model's last layer.
    with pytest.raises(ValueError, match="last pipeline stage ends at layer 4"):
        spec_from_layers([layer], _stage(1), [3])
    whole = EngineGeometry(8, 16, 4, tp_size=2, tp_rank=1, kv_layers=(0, 1, 2))
    with pytest.raises(ValueError, match="without pipeline parallelism a rank holds every layer"):
        spec_from_layers([layer] * 2, whole, [0, 1])


def test_settings_defaults_and_parsing():
    assert ConnectorSettings.from_extra_config(None) == ConnectorSettings()
    parsed = ConnectorSettings.from_extra_config(
        {
            "side_channel_host": "10.0.0.7",
            "side_channel_port": 6100,
            "strategy": "pack+unpack",
            "cost_model": {"seconds_per_op": 1e-5, "link_bytes_per_second": 25e9},
            "fetch_timeout_s": 5,
            "secret": "s",
            "heartbeat_s": 1,
            "peer_timeout_s": 30,
            "handshake_timeout_s": 20,
            "stream_prefill": False,
            "transport": "mooncake",
        }
    )
    assert ConnectorSettings().stream_prefill and not parsed.stream_prefill
    assert parsed.consumer_options("tcp")["transport"] == "mooncake"
    assert parsed.producer_options("tcp")["transport"] == "mooncake"
    assert (parsed.heartbeat_s, parsed.peer_timeout_s, parsed.handshake_timeout_s) == (1, 30, 20)
    assert (parsed.side_channel_host, parsed.side_channel_port) == ("10.0.0.7", 6100)
    assert parsed.strategy == "pack+unpack" and parsed.fetch_timeout_s == 5.0
    assert parsed.cost_model == CostModel(seconds_per_op=1e-5, link_bytes_per_second=25e9)
    preset = ConnectorSettings.from_extra_config({"cost_model": "tcp_loopback"})
    assert preset.cost_model == CostModel.tcp_loopback()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"peer_timeout_s": 0.5}, "peer_timeout_s 0.5 must be longer than heartbeat_s 0.5"),
        ({"heartbeat_s": 0}, r"'heartbeat_s'\] = 0; expected a positive number of seconds"),
        ({"side_chanel_port": 1}, r"unknown key\(s\) \['side_chanel_port'\].*side_channel_port"),
        ({"strategy": "fastest"}, "strategy.*one of"),
        ({"cost_model": {"speed": 1}}, "CostModel fields only"),
        ({"cost_model": "infiniband"}, "rdma.*tcp_loopback"),
        ({"protocol": "udp"}, '"tcp" or "rdma"'),
        ({"side_channel_port": "5700"}, r"0 \(any free port\) or a port in 1..65535"),
        ({"side_channel_port": 65536}, r"0 \(any free port\) or a port in 1..65535"),
        ({"bootstrap_port": 0}, r"'bootstrap_port'\] = 0; expected a port in 1..65535"),
        ({"bootstrap_address": "10.0.0.1"}, r"'bootstrap_address'\]: '10.0.0.1' has no port"),
        ({"bootstrap_address": "tcp://h:1"}, "scheme 'tcp' is not supported"),
        ({"fetch_timeout_s": 0}, "positive number of seconds"),
        ({"backend": "cuda"}, '"auto", "torch" or "triton"'),
        ({"stream_prefill": "yes"}, r"'stream_prefill'\] = 'yes'; expected true or false"),
        ({"transport": "nixl"}, r"'transport'\] = 'nixl'; expected one of \['mooncake'\]"),
        ({"transport": "local"}, "'local' reaches peers in its own process only"),
    ],
)
def test_bad_settings_name_the_key_and_what_it_accepts(extra, message):
    with pytest.raises(ValueError, match=message):
        ConnectorSettings.from_extra_config(extra)


def test_bootstrap_settings():
    defaults = ConnectorSettings()
    assert (defaults.side_channel_port, defaults.bootstrap_port) == (0, 5690)
    assert defaults.bootstrap_address is None
    assert defaults.bootstrap_url() == "http://127.0.0.1:5690"
    node = ConnectorSettings.from_extra_config(
        {"side_channel_host": "10.0.0.7", "bootstrap_port": 6000, "side_channel_port": 0}
    )
    assert node.bootstrap_url("127.0.0.1") == "http://10.0.0.7:6000"  # DP on this node only
    # DP ranks across nodes: the service runs at vLLM's --data-parallel-address.
    assert node.bootstrap_host("10.0.0.1") == "10.0.0.1"
    assert node.bootstrap_url("10.0.0.1") == "http://10.0.0.1:6000"
    assert ConnectorSettings(side_channel_host="::1").bootstrap_url() == "http://[::1]:5690"
    external = ConnectorSettings.from_extra_config({"bootstrap_address": "10.0.0.9:7000"})
    assert external.bootstrap_address == "http://10.0.0.9:7000"
    assert external.bootstrap_url("10.0.0.1") == "http://10.0.0.9:7000"


def test_producer_and_consumer_options_are_their_parameters_from_the_settings():
    import inspect

    from kvxfer.connector import KVConsumer, KVProducer

    s = ConnectorSettings.from_extra_config(
        {"secret": "s3", "staging_bytes": 1 << 20, "staging_slots": 3, "strategy": "direct",
         "request_timeout_s": 9.0, "fetch_timeout_s": 7.0, "peer_timeout_s": 4.0,
         "session_timeout_s": 30.0}
    )  # fmt: skip
    produce, consume = s.producer_options("tcp"), s.consumer_options("rdma")
    for cls, options in ((KVProducer, produce), (KVConsumer, consume)):
        unknown = set(options) - set(inspect.signature(cls.__init__).parameters)
        assert not unknown, f"{cls.__name__} takes no {sorted(unknown)}"
    assert produce == {
        "secret": "s3", "transport": "mooncake", "protocol": "tcp", "staging_bytes": 1 << 20,
        "staging_slots": 3, "request_timeout_s": 9.0, "session_timeout_s": 30.0, "backend": "auto",
    }  # fmt: skip
    assert consume["protocol"] == "rdma" and consume["strategy"] == "direct"
    assert (consume["timeout_s"], consume["peer_timeout_s"]) == (7.0, 4.0)
    assert consume["cost_model"] == s.cost_model and consume["secret"] == "s3"
