"""kvxfer's connectors by name: vLLM's plugin loader runs kvxfer's `vllm.general_plugins` entry
point, which registers `KvxferConnector` and `KvxferECConnector` with vLLM's factories, so a
`--kv-transfer-config` needs no `kv_connector_module_path` (the module path keeps working: the
rest of this suite builds its engines with it). A fresh process each: vLLM loads plugins once
per process and its factories' registries are process-wide."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
from vllm.config import ECTransferConfig, KVTransferConfig
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.plugins import load_general_plugins

import sys
load_general_plugins()
assert "kvxfer.integrations.vllm.connector" not in sys.modules, "the plugin imported a connector"
from kvxfer.integrations import vllm_plugin
vllm_plugin.register()  # vLLM may load plugins again: nothing is registered twice
kv = KVConnectorFactory.get_connector_class(
    KVTransferConfig(kv_connector="KvxferConnector", kv_role="kv_both")
)
ec = ECConnectorFactory.get_connector_class(
    ECTransferConfig(ec_connector="KvxferECConnector", ec_role="ec_producer")
)
print(f"{kv.__module__}.{kv.__name__} {ec.__module__}.{ec.__name__}")
"""


def test_vllm_finds_both_connectors_by_name():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [
        "kvxfer.integrations.vllm.connector.KvxferConnector",
        "kvxfer.integrations.vllm.ec_connector.KvxferECConnector",
    ]
