"""kvxfer's SGLang transfer manager (`KvxferKVManager`, on SGLang's `CommonKVManager`): one
rank's producer or consumers (one a cache group: the target model's pool, and the draft
model's under speculative decoding) and the listener of SGLang's control socket.
`kvxfer.integrations.sglang.conn` has the flow, and the sender and receiver that drive it.

- `prefill`: the producer, the decode ranks' registrations and readings, publishing a request
  at its last chunk, the producer's releases as SGLang's statuses;
- `decode`: the look-up of a prefill engine, a link to each prefill DP group
  (`kvxfer.integrations.sglang.links`), each request's load and fetch;
- `rank`: what both sides share;
- `model`: the settings and the model facts the manager reads from SGLang.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import uuid
from collections.abc import Callable
from typing import Any

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.disaggregation.base.conn import KVArgs
from sglang.srt.disaggregation.utils import DisaggregationMode

from kvxfer.connector.groups import CacheGroup
from kvxfer.integrations.base import EngineAdapter
from kvxfer.integrations.sglang.loaded import scales_of, sliding_window_of
from kvxfer.integrations.sglang.mamba import MAMBA, mamba_groups, mamba_model
from kvxfer.integrations.sglang.manager.decode import DecodeLoad, DecodeSide
from kvxfer.integrations.sglang.manager.model import (
    SWA,
    latent_scales,
    load_settings,
    model_of,
    pool_device,
    pool_entries,
    state_kinds,
    window_split,
)
from kvxfer.integrations.sglang.manager.prefill import PrefillSide, Send
from kvxfer.integrations.sglang.pools import SGLangModel, sglang_cache
from kvxfer.spec import FP8_DTYPES

__all__ = ["DecodeLoad", "KvxferKVManager", "Send", "load_settings", "model_of"]

log = logging.getLogger(__name__)


class KvxferKVManager(PrefillSide, DecodeSide):
    """One rank's kvxfer endpoint inside SGLang: a `GroupedProducer` (prefill) or
    `GroupedConsumer`s, one per prefill DP group it reads (decode), over SGLang's pools, plus
    the listener of SGLang's control socket (the module docstring)."""

    # The pages of a failed or aborted load are held until its fetch ended (no late byte lands
    # in a page SGLang gave to another request): `is_abort_release_safe`.
    supports_deferred_decode_kv_release = True

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        super().__init__(args, disaggregation_mode, server_args, bool(is_mla_backend))
        self.settings = load_settings()
        self.host = os.environ.get("KVXFER_HOST") or self.local_ip
        self._prefill = disaggregation_mode == DisaggregationMode.PREFILL
        if not self._prefill and self.pp_size > 1:
            raise ValueError(
                "kvxfer's SGLang backend: decode pipeline parallelism is not supported; "
                "serve the decode engine with --pp-size 1 (the prefill may use any)"
            )
        self._lock = threading.Lock()
        handle: Callable[[list[bytes]], None]
        if self._prefill:
            self.engine_id = f"sglang-prefill-{uuid.uuid4().hex[:12]}"
            handle = self._on_prefill_message
        else:
            host = getattr(server_args, "host", "127.0.0.1")
            port = getattr(server_args, "port", 0)
            self.engine_id = f"sglang-decode-{host}:{port}-dp{self.attn_dp_rank}"
            handle = self._on_decode_message
        self.register_kv_caches(args)
        listener = threading.Thread(target=self._listen, args=(handle,), name="kvxfer-sglang")
        listener.daemon = True
        listener.start()

    def register_kv_caches(self, caches: KVArgs) -> None:
        """Geometry -> spec (the engine-adapter contract, `kvxfer.integrations.base`): the
        rank's pools, from SGLang's `KVArgs`, as cache groups; a prefill starts serving and
        `register`s its side channels, a decode starts keeping its links and loads."""
        self.groups = self._cache_groups(self.server_args, caches, bool(self.is_mla_backend))
        self.spec = self.groups[0].spec
        if self._prefill:
            self._start_prefill()
        else:
            self._start_decode()

    def _cache_groups(self, server_args: Any, args: KVArgs, mla: bool) -> list[CacheGroup]:
        """The rank's pools as kvxfer's cache groups: the target model's, then the draft
        model's where speculative decoding keeps one (its pages are the target's: SGLang
        sends one page list for both), then the hybrid state's (a window pool's, or a Mamba
        state's groups)."""
        target, draft = pool_entries(args)
        kinds = state_kinds(args)
        self._check_hybrid(kinds, kv=target.start != target.stop)
        config = ModelConfig.from_server_args(server_args)  # the target's, read once
        target_model = model_of(server_args, args, mla, config=config)
        groups = []
        for entries, is_draft in ((target, False), (draft, True)):
            if is_draft and entries.start == entries.stop:
                break
            if is_draft and self.pp_size > 1:
                raise ValueError(
                    "kvxfer's SGLang backend: speculative decoding's draft KV with prefill "
                    "pipeline parallelism is not supported; serve the prefill with --pp-size 1"
                )
            spec, caches = sglang_cache(
                args.kv_data_ptrs[entries],
                args.kv_data_lens[entries],
                args.kv_item_lens[entries],
                args.page_size,
                model_of(server_args, args, mla, draft=True) if is_draft else target_model,
                tp_size=self.attn_tp_size,
                tp_rank=self.attn_tp_rank,
                pp_size=1 if is_draft else self.pp_size,
                pp_rank=0 if is_draft else self.pp_rank,
                layer_start=0 if is_draft else target_model.layer_start,
                device=pool_device(server_args, args),
            )
            groups.append(CacheGroup(spec, caches))
        if kinds == [SWA]:
            groups.append(self._window_group(server_args, args, mla, target_model, config))
        if kinds == [MAMBA]:
            groups += self._mamba_groups(server_args, args, config)
        return groups

    @staticmethod
    def _check_hybrid(kinds: list[str], kv: bool) -> None:
        """Refuse, before any pool is read, a rank with hybrid state but no KV layers (a Mamba
        model without attention, or a pipeline stage of none): kvxfer moves state beside a
        KV pool. (A draft beside a Mamba target moves as any draft: SGLang registers the
        draft's KV after the target's and no state of the draft's, `setup_state_kv_args`.)"""
        if kinds and not kv:
            raise ValueError(
                "kvxfer's SGLang backend: this rank keeps no attention layers, only "
                f"{', '.join(kinds)} state (a model without attention, such as Falcon-Mamba, or "
                "a pipeline stage of none); kvxfer moves the state beside a KV pool: serve it "
                "with another transfer backend, or with stages that each hold attention layers"
            )

    def _mamba_groups(self, server_args: Any, args: KVArgs, config: Any) -> list[CacheGroup]:
        """The target model's Mamba state (SGLang's one "mamba" state) as state groups
        (`kvxfer.integrations.sglang.mamba`): a request's table is its slot."""
        return mamba_groups(
            args, 0, mamba_model(config, self.attn_tp_size),
            tp_size=self.attn_tp_size, tp_rank=self.attn_tp_rank,
            pp_size=self.pp_size, pp_rank=self.pp_rank, device=pool_device(server_args, args),
        )  # fmt: skip

    def _window_group(
        self, server_args: Any, args: KVArgs, mla: bool, target: SGLangModel, config: Any
    ) -> CacheGroup:
        """The window layers' pool (`SWAKVPool`'s, SGLang's one "swa" state) as a
        sliding-window group of the `target` model's heads: its layers placed among the
        model's window layers (`window_split`: a pipeline stage's), each with its own fp8
        scales; its pages the request's window pages (its state indices); its window the one
        SGLang's model runner resolved."""
        ptrs, lens, item_lens = (
            args.state_data_ptrs[0], args.state_data_lens[0], args.state_item_lens[0]
        )  # fmt: skip
        split = window_split(config, args, mla, self.pp_size)
        scales: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())
        if target.dtype in FP8_DTYPES:
            scales = (latent_scales if mla else scales_of)(split.stage_window)
        model = dataclasses.replace(
            target, total_layers=len(split.window), k_scales=scales[0], v_scales=scales[1],
            layer_start=split.window.index(split.stage_window[0]),
        )  # fmt: skip
        spec, caches = sglang_cache(
            ptrs, lens, item_lens, args.page_size, model,
            tp_size=self.attn_tp_size, tp_rank=self.attn_tp_rank,
            pp_size=self.pp_size, pp_rank=self.pp_rank, layer_start=model.layer_start,
            device=pool_device(server_args, args),
        )  # fmt: skip
        return CacheGroup(spec, caches, sliding_window=sliding_window_of())

    def _listen(self, handle: Callable[[list[bytes]], None]) -> None:
        """Serve the control messages on the PULL socket Common bound: `handle` each; a bad
        one is logged, and the next served."""
        recv = self._make_worker_recv(self.server_socket)
        while True:
            msg = recv()
            if msg is None:
                continue
            try:
                handle(msg)
            except Exception:
                log.exception("kvxfer: bad control message %r", msg[:1])


def _keeps_the_adapter_contract(
    manager: KvxferKVManager,
) -> EngineAdapter[KVArgs, Send, DecodeLoad, tuple[str, int]]:
    """Never called: mypy checks here that the SGLang manager keeps the engine-adapter
    contract (`kvxfer.integrations.base`), and `make test-sglang` that its members are the
    contract's."""
    return manager
