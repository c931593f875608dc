"""Serving-engine integrations. `kvxfer.integrations.vllm` needs vLLM (`kvxfer[vllm]`); the
other modules here import no engine."""
