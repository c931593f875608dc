"""The fp8 KV scales of the model this SGLang process serves, read where SGLang keeps them.

SGLang quantizes K and V into an fp8 pool with each attention layer's own scale
(`RadixAttention.k_scale` and `v_scale`: a 0-dim float32 parameter a checkpoint's KV scales
fill, or None without them, then no division). Its transfer backends are handed the pools'
pointers (`KVArgs`), never the model, so the plugin records the scales as the model runner
finishes loading the target model (an AFTER hook on `ModelRunner.load_model`, registered by
`kvxfer.integrations.sglang.plugin`); the KV manager, built later in the same scheduler process,
puts them in its specs. A draft model's runner (speculative decoding) loads the draft model,
whose own pool's scales are recorded apart.

A converting transfer needs the fp8 side's scales, and kvxfer never guesses them: an fp8 pool in
a process where no model was recorded is refused when the manager starts (`scales_of`).
"""

from __future__ import annotations

import threading
from typing import Any

_LOCK = threading.Lock()
# Per model (False: the target, True: the draft): each attention layer's (k_scale, v_scale).
_RECORDED: dict[bool, dict[int, tuple[float, float]]] = {}


def _scale(value: Any) -> float:
    """A layer's scale as SGLang divides by it: its float32 value, 1.0 where it has none."""
    return 1.0 if value is None else float(value)


def record_model_scales(model: Any, draft: bool = False) -> None:
    """Record the K and V scale of every attention layer of `model` (modules with a `layer_id`
    and `k_scale`/`v_scale` attributes: SGLang's `RadixAttention`), the target model's or the
    `draft` model's, replacing that model's before."""
    scales = {
        int(module.layer_id): (_scale(module.k_scale), _scale(module.v_scale))
        for module in model.modules()
        if hasattr(module, "layer_id") and hasattr(module, "k_scale") and hasattr(module, "v_scale")
    }
    with _LOCK:
        _RECORDED[draft] = scales


def after_load_model(result: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    """(SGLang's `ModelRunner.load_model`, AFTER hook) Record the loaded model's scales."""
    record_model_scales(runner.model, draft=bool(getattr(runner, "is_draft_worker", False)))
    return result


def forget_model_scales() -> None:
    """Forget what was recorded (a test's fresh process state)."""
    with _LOCK:
        _RECORDED.clear()


def scales_of(
    layers: range | int, draft: bool = False
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The recorded K and V scales of `layers` (global layer ids) of the target model, in
    order; of the `draft` model, its first `layers` attention layers (an int: a draft pool's
    layers are its model's, in order).

    Raises:
        ValueError: no such model was recorded in this process, or it lacks one of `layers`,
            naming the fix.
    """
    model = "draft model" if draft else "model"
    with _LOCK:
        recorded = _RECORDED.get(draft)
    if recorded is None:
        raise ValueError(
            f"an fp8 KV pool, but no {model}'s k_scale/v_scale were recorded in this process: "
            "kvxfer reads them as SGLang's ModelRunner loads the model (its plugin's hook on "
            "ModelRunner.load_model); load SGLang's plugins before the model (SGLang's "
            "load_plugins does, in every scheduler process)"
        )
    if isinstance(layers, int):
        layers = range(min(recorded, default=0), min(recorded, default=0) + layers)
    missing = [layer for layer in layers if layer not in recorded]
    if missing:
        raise ValueError(
            f"layers {missing}: no attention layer with k_scale/v_scale in the recorded {model} "
            f"(it has layers {sorted(recorded)}); kvxfer cannot tell these layers' fp8 scales"
        )
    return (
        tuple(recorded[layer][0] for layer in layers),
        tuple(recorded[layer][1] for layer in layers),
    )
