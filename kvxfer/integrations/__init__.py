"""Serving-engine integrations. `kvxfer.integrations.vllm` needs vLLM (`kvxfer[vllm]`),
`kvxfer.integrations.sglang.conn` needs SGLang (`kvxfer[sglang]`); the other modules here
import no engine."""
