"""kvxfer inside vLLM: `KvxferConnector` (KV cache, P/D disaggregation) and
`KvxferECConnector` (encoder cache). Needs `pip install 'kvxfer[vllm]'`; the rest of kvxfer never
imports vLLM.

Load it by name (kvxfer's `vllm.general_plugins` entry point registers both connectors with
vLLM's factories: `kvxfer.integrations.vllm_plugin`)::

    --kv-transfer-config '{"kv_connector": "KvxferConnector",
                           "kv_role": "kv_producer", "kv_connector_extra_config": {...}}'

or with `"kv_connector_module_path": "kvxfer.integrations.vllm"` where plugins are off.

P/D flow (the conventions of vLLM's own P/D connectors):
1. The proxy sends a request to the prefill engine with `kv_transfer_params =
   {"do_remote_decode": true}` and `max_tokens = 1`.
2. When it finishes, `request_finished` keeps its blocks (delayed free) and returns the
   parameters the decode engine needs: `do_remote_prefill`, `remote_engine_id`,
   `remote_request_id`, `remote_bootstrap_addr`, `remote_dp_rank`, `remote_host`,
   `remote_block_ids`, `remote_num_tokens`, `tp_size`, `pp_size` (and `remote_port` with fixed
   ports).
   The next step's metadata tells every prefill worker to publish the request on its
   `KVProducer`. Every prefill worker registered its side channel with the engine's bootstrap
   service (`kvxfer.integrations.bootstrap`, started by the scheduler of DP rank 0).
3. The proxy sends the request to the decode engine with those parameters. Its scheduler
   reports the prompt as externally computed and loaded asynchronously; every decode worker
   fetches its heads of its stage's layers with a `KVConsumer` (one per remote engine and DP
   rank, connected on first use to every worker of that DP rank, every pipeline stage's, found
   through the bootstrap service, off the engine's
   step, strategies planned per rank pair then; looked up and connected again when a prefill
   rank died or a load failed: a restarted engine).
4. A finished fetch is reported through `get_transfer_results`; blocks that failed come back through
   `get_block_ids_with_load_errors`, so vLLM recomputes exactly them (a model with several
   KV cache groups fails the request whole: `get_transfer_results`' `failed_recving`). Once
   every decode worker (every TP rank of every stage) reported done (or `request_timeout_s`
   passed), each prefill worker reports the request as finished sending, and vLLM frees its
   blocks once every worker of the prefill engine did (its `KVOutputAggregator` counts
   `world_size` reports; the same on the decode side for finished loads).
The concurrent flow (`vllm-router --kv-connector mooncake`, vLLM MooncakeConnector's
convention): the router reads the prefill engine's id per DP rank from the bootstrap service's
`/query`, mints a `transfer_id` and sends the request to both engines at once, the prefill
with `{"do_remote_decode": true, "transfer_id": ...}`, the decode with `{"do_remote_prefill":
true, "transfer_id": ..., "remote_engine_id": ..., "remote_bootstrap_addr": ...}`. The decode
engine starts its load at once (the producers hold the asks); the prefill engine publishes the
request under the `transfer_id` when it finishes (step 2), and the held asks are served then.
5. A decode request that vLLM finishes before its KV was loaded (aborted while waiting or
   loading, or a full local prefix hit) is aborted on the prefill engine through the next
   step's metadata (`KVConsumer.abort`), which frees its blocks at once, as vLLM's NIXL
   connector does.

Any KV cache layout on either side works: the geometry is read from the registered tensors
(`kvxfer.integrations.kv_tensors`), so `get_required_kvcache_layout` asks for none.
"""

from kvxfer.integrations.vllm.connector import KvxferConnector
from kvxfer.integrations.vllm.ec_connector import KvxferECConnector, KvxferECConnectorMetadata
from kvxfer.integrations.vllm.metadata import (
    AbortSpec,
    KvxferConnectorMetadata,
    LoadSpec,
    SendSpec,
)
from kvxfer.integrations.vllm.stats import KvxferConnectorStats

__all__ = [
    "AbortSpec",
    "KvxferConnector",
    "KvxferConnectorMetadata",
    "KvxferConnectorStats",
    "KvxferECConnector",
    "KvxferECConnectorMetadata",
    "LoadSpec",
    "SendSpec",
]
