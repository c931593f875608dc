"""Serving-engine integrations. `kvxfer.integrations.vllm` needs vLLM (`kvxfer[vllm]`),
`kvxfer.integrations.sglang.conn` needs SGLang (`kvxfer[sglang]`); `vllm_plugin` (vLLM's plugin
entry point) imports vLLM only when vLLM calls it; the other modules here import no engine."""
