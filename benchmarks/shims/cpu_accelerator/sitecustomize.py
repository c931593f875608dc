"""A start-up shim for vLLM's own MooncakeConnector on vLLM's CPU build, for
`benchmarks/pd_serve.py` only (on the PYTHONPATH of those engines and of no other process).

MooncakeConnector's worker asks `torch.accelerator.current_device_index()` at start, which a
CPU-only torch cannot answer ("RuntimeError: Cannot access accelerator device when none is
available."), and hands the answer to `current_platform.set_device`, which the CPU platform
ignores. With no accelerator, this answers 0; with one, torch's own answer stands. Nothing
else changes: the connector then runs as written, over Mooncake TCP.
"""

import torch

if not torch.accelerator.is_available():
    torch.accelerator.current_device_index = lambda: 0
