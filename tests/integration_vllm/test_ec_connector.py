"""`KvxferECConnector` created by vLLM's own EC connector factory in both roles: an encoder
instance's worker saves an item's output, a prefill instance's scheduler finds it and its
worker loads it bit for bit through kvxfer's Mooncake encoder-cache connector (TCP loopback)."""

from __future__ import annotations

import pytest
import torch
from pd_engines import MULTIMODAL_MODEL, free_port_base, write_model


def _config(model_dir: str, role: str, extra: dict):
    from vllm.config import DeviceConfig, ECTransferConfig, ModelConfig, VllmConfig

    return VllmConfig(
        model_config=ModelConfig(
            model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024
        ),
        device_config=DeviceConfig("cpu"),
        ec_transfer_config=ECTransferConfig(
            ec_connector="KvxferECConnector",
            ec_connector_module_path="kvxfer.integrations.vllm",
            ec_role=role,
            ec_connector_extra_config=extra,
        ),
    )


def _request(request_id: str, identifiers: list[str]):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    features = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=identifier,
            mm_position=PlaceholderRange(offset=2 + 10 * i, length=8),
        )
        for i, identifier in enumerate(identifiers)
    ]
    prompt = list(range(2 + 10 * len(identifiers)))
    return Request(request_id, prompt, SamplingParams(max_tokens=1), None, mm_features=features)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model"), MULTIMODAL_MODEL)


def test_encoder_output_moves_from_encoder_to_prefill_instance(model_dir):
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    port = free_port_base(1)
    producer_cfg = _config(
        model_dir, "ec_producer", {"backend": "MooncakeECConnector", "port": port}
    )
    consumer_cfg = _config(
        model_dir,
        "ec_consumer",
        {"backend": "MooncakeECConnector", "producer_addresses": [f"tcp://127.0.0.1:{port}"]},
    )
    encoder_worker = ECConnectorFactory.create_connector(producer_cfg, ECConnectorRole.WORKER)
    scheduler = ECConnectorFactory.create_connector(consumer_cfg, ECConnectorRole.SCHEDULER)
    prefill_worker = ECConnectorFactory.create_connector(consumer_cfg, ECConnectorRole.WORKER)
    try:
        output = torch.randn(8, 192, generator=torch.Generator().manual_seed(5)).bfloat16()
        encoder_worker.save_caches({"img-1": output}, "img-1")

        request = _request("req-1", ["img-1", "img-2"])
        assert scheduler.has_cache_item("img-1") is True
        assert scheduler.has_cache_item("img-2") is False  # never encoded: computed locally
        scheduler.update_state_after_alloc(request, 0)
        scheduler.update_state_after_alloc(request, 1)
        metadata = scheduler.build_connector_meta(None)
        assert metadata.mm_hashes == ["img-1"]

        encoder_cache: dict[str, torch.Tensor] = {}
        prefill_worker.bind_connector_metadata(metadata)
        prefill_worker.start_load_caches(encoder_cache)
        prefill_worker.clear_connector_metadata()
        assert set(encoder_cache) == {"img-1"}
        got = encoder_cache["img-1"]
        assert got.dtype == output.dtype and got.shape == output.shape
        assert torch.equal(got.view(torch.int16), output.view(torch.int16))
        assert scheduler.request_finished(request) == (False, None)
    finally:
        for connector in (prefill_worker, scheduler, encoder_worker):
            connector.shutdown()


def test_ec_both_is_refused_with_the_fix(model_dir):
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    config = _config(model_dir, "ec_both", {"backend": "SharedStorageECConnector"})
    with pytest.raises(ValueError, match=r"'ec_producer'.*'ec_consumer'"):
        ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
