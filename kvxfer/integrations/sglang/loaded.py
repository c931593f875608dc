"""What SGLang's model runner loaded that kvxfer's SGLang backend needs and the pools do not
say: each attention layer's fp8 KV scales, and the model's sliding window.

SGLang quantizes K and V into an fp8 pool with each attention layer's own scale
(`RadixAttention.k_scale` and `v_scale`: a 0-dim float32 parameter a checkpoint's KV scales
fill, or None without them, then no division); a sliding-window model's window is what the
model runner resolves as it loads the model (`ModelRunner.sliding_window_size`: Gemma's is its
config's `sliding_window - 1`, so the config alone does not tell). Its transfer backends are
handed the pools' pointers (`KVArgs`), never the model, so the plugin records both as the model
runner finishes loading the target model (an AFTER hook on `ModelRunner.load_model`, registered
by `kvxfer.integrations.sglang.plugin`); the KV manager, built later in the same scheduler
process, puts them in its specs and cache groups. A draft model's runner (speculative decoding)
loads the draft model, whose own pool's scales are recorded apart.

kvxfer never guesses either: an fp8 pool in a process where no model was recorded is refused
when the manager starts (`scales_of`), and so is a sliding-window pool without a recorded
window (`sliding_window_of`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

_LOCK = threading.Lock()
# Per model (False: the target, True: the draft): each attention layer's (k_scale, v_scale).
_RECORDED: dict[bool, dict[int, tuple[float, float]]] = {}
# Per model: the attention window in tokens that its runner resolved (None: full attention).
_WINDOWS: dict[bool, int | None] = {}


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


def record_sliding_window(window: int | None, draft: bool = False) -> None:
    """Record the target (or `draft`) model's attention window in tokens, as its runner
    resolved it (`ModelRunner.sliding_window_size`; None: full attention)."""
    with _LOCK:
        _WINDOWS[draft] = None if window is None else int(window)


def after_load_model(result: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    """(SGLang's `ModelRunner.load_model`, AFTER hook) Record the loaded model's scales and
    sliding window."""
    draft = bool(getattr(runner, "is_draft_worker", False))
    record_model_scales(runner.model, draft=draft)
    record_sliding_window(getattr(runner, "sliding_window_size", None), draft=draft)
    return result


def forget_model_scales() -> None:
    """Forget what was recorded, scales and windows (a test's fresh process state)."""
    with _LOCK:
        _RECORDED.clear()
        _WINDOWS.clear()


def sliding_window_of(draft: bool = False) -> int:
    """The recorded attention window of the target (or `draft`) model, in tokens, as SGLang's
    model runner resolved it (`sliding_window_size`; what a query attends with it differs by
    one between SGLang's attention backends: the manager's decode side fetches the wider).

    Raises:
        ValueError: none was recorded in this process, or the model has none, naming the fix.
    """
    with _LOCK:
        recorded = draft in _WINDOWS
        window = _WINDOWS.get(draft)
    if not recorded:
        raise ValueError(
            "a sliding-window KV pool, but no model's sliding window was recorded in this "
            "process: kvxfer reads it as SGLang's ModelRunner loads the model (its plugin's hook "
            "on ModelRunner.load_model); load SGLang's plugins before the model"
        )
    if not window or window < 1:
        raise ValueError(
            f"a sliding-window KV pool, but the loaded model's sliding window is {window!r}: "
            "kvxfer cannot tell which tokens the window pool holds"
        )
    return window


def scales_of(
    layers: Sequence[int] | int, draft: bool = False
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
