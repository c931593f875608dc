"""kvxfer: move LLM KV caches between differently sharded prefill and decode engines."""

from kvxfer.connector import FetchHandle, KVConsumer, KVProducer, TransferResult
from kvxfer.plan import STRATEGIES, CostModel, PairPlan, plan_pairs
from kvxfer.reshard import PairReport, ReshardResult, reshard
from kvxfer.spec import KVCacheSpec, allocate_kv_caches, decode_spec, encode_spec

__all__ = [
    "STRATEGIES",
    "CostModel",
    "FetchHandle",
    "KVCacheSpec",
    "KVConsumer",
    "KVProducer",
    "PairPlan",
    "PairReport",
    "ReshardResult",
    "TransferResult",
    "allocate_kv_caches",
    "decode_spec",
    "encode_spec",
    "plan_pairs",
    "reshard",
]
