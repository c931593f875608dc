"""Mamba2-shaped recurrent state for the state tests: a model's global states, each rank's pages
packed as vLLM packs them (`MambaBase.bind_kv_cache`: the conv state, DS layout, then the SSM
state, each rank holding its slice of every sub-projection), written by plain indexing here,
independently of `kvxfer.state`."""

from __future__ import annotations

import torch

from kvxfer.state import StateComponent, StateLayout

X, GROUPS_SS, STATE_LEN = 16, 8, 3  # conv sub-projections x, B, C: 16 + 8 + 8 channels
SSM_HEADS, HEAD_DIM, D_STATE = 8, 4, 4
PAGE_BYTES, NUM_BLOCKS, NUM_LAYERS = 1024, 6, 2


def components(state_len: int = STATE_LEN) -> tuple[StateComponent, ...]:
    """Conv state `[x + 2 * groups_ss, state_len]` bf16, SSM state `[heads, hd, d_state]` fp32
    (`state_len` 3: 6-byte rows, vLLM's usual; 8: 16-byte rows, every slice 16-byte aligned)."""
    return (
        StateComponent(X + 2 * GROUPS_SS, (state_len,), torch.bfloat16, (X, GROUPS_SS, GROUPS_SS)),
        StateComponent(SSM_HEADS, (HEAD_DIM, D_STATE), torch.float32),
    )


def grouped_components(state_len: int = STATE_LEN) -> tuple[StateComponent, ...]:
    """The same conv state of one Mamba group (`n_groups` 1): x by channels, then B and C one
    row each of all their channels, which every rank beyond TP 1 holds whole (SGLang's and
    vLLM's Mamba2 mixers with fewer groups than ranks); then the SSM state."""
    return (
        StateComponent(X, (state_len,), torch.bfloat16),
        StateComponent(1, (GROUPS_SS, state_len), torch.bfloat16),
        StateComponent(1, (GROUPS_SS, state_len), torch.bfloat16),
        StateComponent(SSM_HEADS, (HEAD_DIM, D_STATE), torch.float32),
    )


def layout(tp: int, rank: int, state_len: int = STATE_LEN, grouped: bool = False) -> StateLayout:
    """One rank's layout (`grouped`: of `grouped_components`)."""
    parts = grouped_components(state_len) if grouped else components(state_len)
    return StateLayout(parts, PAGE_BYTES, tp, rank)


def global_states(seed: int, state_len: int = STATE_LEN) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(conv, ssm) of every layer: the model's whole state after some prompt."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(X + 2 * GROUPS_SS, state_len, generator=gen).to(torch.bfloat16),
            torch.randn(SSM_HEADS, HEAD_DIM, D_STATE, generator=gen),
        )
        for _ in range(NUM_LAYERS)
    ]


def rank_page(
    conv: torch.Tensor, ssm: torch.Tensor, tp: int, rank: int, grouped: bool = False
) -> torch.Tensor:
    """One layer's page bytes on one rank: its x, B and C slices (`grouped`: its x slice, B and
    C whole), then its SSM heads."""
    parts = []
    for start, size in ((0, X), (X, GROUPS_SS), (X + GROUPS_SS, GROUPS_SS)):
        per = size if grouped and start else size // tp
        first = start if grouped and start else start + rank * per
        parts.append(conv[first : first + per])
    local_conv = torch.cat(parts).contiguous().view(torch.uint8).reshape(-1)
    per = SSM_HEADS // tp
    local_ssm = ssm[rank * per : (rank + 1) * per].contiguous().view(torch.uint8).reshape(-1)
    return torch.cat([local_conv, local_ssm])


def pages(fill: int | None = None, seed: int = 0, device: str = "cpu") -> list[torch.Tensor]:
    """A rank's page tensors, one per layer: poison (`fill`) or random bytes."""
    gen = torch.Generator().manual_seed(seed)
    result = []
    for _ in range(NUM_LAYERS):
        if fill is None:
            page = torch.randint(0, 256, (NUM_BLOCKS, PAGE_BYTES), generator=gen).to(torch.uint8)
        else:
            page = torch.full((NUM_BLOCKS, PAGE_BYTES), fill, dtype=torch.uint8)
        result.append(page.to(device))
    return result


def write_state(layer_pages, states, tp: int, rank: int, block: int, grouped: bool = False) -> None:
    """Put a request's state (in block `block`) into a rank's pages."""
    for page, (conv, ssm) in zip(layer_pages, states, strict=True):
        data = rank_page(conv, ssm, tp, rank, grouped).to(page.device)
        page[block, : data.numel()] = data
