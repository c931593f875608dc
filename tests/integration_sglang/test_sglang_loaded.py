"""The fp8 KV scales kvxfer's SGLang backend puts in its spec: read from SGLang's own attention
layers (`RadixAttention`, with the scales SGLang's `BaseKVCacheMethod` loads) as the plugin's
hook on `ModelRunner.load_model` records them (a draft model's apart), and refused, never
guessed, where none were."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from ranks import kv_scales
from test_sglang_plugin import _python

from kvxfer.integrations.sglang import plugin
from kvxfer.integrations.sglang.loaded import (
    after_load_model,
    forget_model_scales,
    record_model_scales,
    scales_of,
    sliding_window_of,
)


def _attention(layers: range, scaled: bool) -> torch.nn.Module:
    """A model's attention layers as SGLang builds them, with checkpoint scales if `scaled`."""
    from sglang.srt.layers.quantization.kv_cache import BaseKVCacheMethod
    from sglang.srt.layers.radix_attention import RadixAttention

    model = torch.nn.ModuleList()
    for layer in layers:
        attention = RadixAttention(4, 16, 1.0, 4, layer)
        if scaled:
            method = BaseKVCacheMethod(None)
            method.create_weights(attention)
            attention.k_scale.data.fill_(kv_scales(layer)[0])
            attention.v_scale.data.fill_(kv_scales(layer)[1])
            method.process_weights_after_loading(attention)
        model.append(attention)
    return torch.nn.Sequential(model)


@pytest.fixture(autouse=True)
def _fresh() -> None:
    forget_model_scales()


def test_the_plugin_hooks_sglangs_model_loading():
    done = _python(
        f"""
        import json
        from sglang.srt.model_executor.model_runner import ModelRunner
        original = id(ModelRunner.__dict__["load_model"])  # an id: the patch rebinds names
        from sglang.srt.plugins import load_plugins
        from sglang.srt.plugins.hook_registry import HookRegistry
        load_plugins()
        print(json.dumps({{
            "wraps_the_original": id(ModelRunner.__dict__["load_model"].__wrapped__) == original,
            "hooks": [
                [kind.name, hook.__module__ + "." + hook.__name__]
                for kind, hook, _ in HookRegistry._hooks[{plugin.LOAD_MODEL!r}]
            ],
        }}))
        """
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["hooks"] == [["AFTER", "kvxfer.integrations.sglang.loaded.after_load_model"]]
    assert out["wraps_the_original"]


def test_the_target_models_scales_and_the_draft_models_are_recorded_apart():
    target = SimpleNamespace(model=_attention(range(4), True), is_draft_worker=False)
    draft = SimpleNamespace(model=_attention(range(4, 5), False), is_draft_worker=True)
    after_load_model(None, target)
    after_load_model(None, draft)
    k, v = scales_of(range(1, 3))
    assert (k, v) == ((kv_scales(1)[0], kv_scales(2)[0]), (kv_scales(1)[1], kv_scales(2)[1]))
    assert scales_of(1, draft=True) == ((1.0,), (1.0,))  # the draft's first layer (id 4)
    with pytest.raises(ValueError, match=r"layers \[5\]: no attention layer .* draft model"):
        scales_of(2, draft=True)


def test_a_model_without_kv_scales_divides_by_one():
    record_model_scales(_attention(range(2), False))
    assert scales_of(range(2)) == ((1.0, 1.0), (1.0, 1.0))


def test_an_fp8_pool_without_recorded_scales_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"no model's k_scale/v_scale were recorded.*load_plugins"):
        scales_of(range(4))


def test_a_layer_the_recorded_model_lacks_is_refused_naming_it():
    record_model_scales(_attention(range(2), True))  # a pipeline stage's layers 0 and 1
    with pytest.raises(ValueError, match=r"layers \[2, 3\]: no attention layer"):
        scales_of(range(4))


def test_the_window_the_model_runner_resolved_is_recorded_per_model():
    # Gemma's runner resolves its config's sliding_window - 1: the runner's, not the config's.
    target = SimpleNamespace(model=_attention(range(2), False), sliding_window_size=511)
    draft = SimpleNamespace(model=_attention(range(2, 3), False), is_draft_worker=True)
    after_load_model(None, target)
    after_load_model(None, draft)
    assert sliding_window_of() == 511
    with pytest.raises(ValueError, match=r"sliding window is None"):
        sliding_window_of(draft=True)  # a draft of full attention


def test_a_window_pool_without_a_recorded_window_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"no model's sliding window was recorded.*plugins"):
        sliding_window_of()
