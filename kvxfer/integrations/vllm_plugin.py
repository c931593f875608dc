"""The entry point vLLM's plugin loader runs (`vllm.general_plugins`, registered by kvxfer's
`pyproject.toml`): it registers `KvxferConnector` and `KvxferECConnector` by name with vLLM's
connector factories, so that `{"kv_connector": "KvxferConnector"}` works without
`kv_connector_module_path` (which keeps working: vLLM tries a module path first).

vLLM calls `load_general_plugins()` in its front end, its engine core and every worker, so each
process that builds a connector has the names. Registration is lazy, as for vLLM's own
connectors: the factories store the module path and import it when a connector is built, so
loading the plugin imports none of kvxfer's connectors (hence this module sits beside the
`kvxfer.integrations.vllm` package, whose import loads them). Calling `register` again
registers nothing new (vLLM may load plugins more than once per process; its factories refuse
a name twice).
"""

from __future__ import annotations

MODULE = "kvxfer.integrations.vllm"
KV_CONNECTOR = "KvxferConnector"
EC_CONNECTOR = "KvxferECConnector"


def register() -> None:
    """Register kvxfer's KV and encoder-cache connectors with vLLM's factories, by name."""
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for factory, name in ((KVConnectorFactory, KV_CONNECTOR), (ECConnectorFactory, EC_CONNECTOR)):
        if name not in factory._registry:
            factory.register_connector(name, MODULE, name)
