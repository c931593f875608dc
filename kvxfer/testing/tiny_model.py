"""A tiny Qwen2-style model made here, for real `vllm serve` engines on a CPU machine.

Nothing comes from a model hub: a BPE tokenizer trained on a few sentences (`tokenizers`) and
a 2-layer Qwen2 config with random weights from a fixed seed (`transformers`), saved as a
directory that `vllm serve DIR` loads. The same seed gives the same weights, so greedy outputs
are deterministic. float32 weights: with bf16, near-ties between the first two choices flip
greedy tokens between engines that round differently.

    python -m kvxfer.testing.tiny_model OUT_DIR [--geometry kv6]

Geometries (`GEOMETRIES`, chosen for kvxfer's e2e tests): the default has 4 KV heads of
head_dim 32, so TP 2 splits them 2 + 2; "kv6" has 6 (TP 2 and TP 3 both split them, neither TP
size divides the other); "kv1" and "kv2" have fewer KV heads than attention heads (GQA), so at
TP 2 vLLM replicates "kv1"'s one head on both ranks. vLLM's CPU attention takes head sizes that
are multiples of 32 (its `vec` path; 16 for `vec16`), so `hidden_size` is heads x head_dim.
`max_position_embeddings` 8192, so a ~4k-token prompt fits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

SEED = 1234
NUM_LAYERS = 2
MAX_POSITIONS = 8192
VOCAB_TARGET = 512
# Weights drawn wider than transformers' default (0.02): logits of a random model with the
# default are nearly flat, so greedy choices would hang on near-ties.
INITIALIZER_RANGE = 0.25
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")

_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "A prefill engine computes the keys and values of every prompt token.",
    "A decode engine continues the text, one token at a time, from the transferred cache.",
    "Blocks of thirty-two or sixty-four tokens hold the cache in paged memory.",
    "Tensor parallel ranks split the attention heads between them.",
    "Zoo inventory: the blue whale of pen 7 weighs 42 kilograms and eats 3 meals a day.",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000",
)


@dataclasses.dataclass(frozen=True)
class TinyGeometry:
    """One tiny model: its architecture (`ARCHITECTURES`), `layers` decoder layers, `heads`
    query heads and `kv_heads` KV heads of `head_dim`. `intermediate_size` divides by every
    TP size the tests serve it at (vLLM splits the MLP's columns over the TP ranks), and so
    does the vocabulary once vLLM pads it to a multiple of 64 (the trained tokenizer's 504
    tokens pad to 512, which TP 3 cannot split: `vocab_size` grows the tokenizer with added
    tokens; None keeps its own size)."""

    name: str
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 32
    intermediate_size: int = 256
    vocab_size: int | None = None
    arch: str = "qwen2"
    layers: int = NUM_LAYERS

    @property
    def hidden_size(self) -> int:
        """heads x head_dim: the attention's width equals the model's."""
        return self.heads * self.head_dim


DEFAULT = TinyGeometry("kv4")
GEOMETRIES = {
    g.name: g
    for g in (
        DEFAULT,
        # TP 2 and TP 3 both split 6 heads (3 + 3, 2 + 2 + 2); 384 and 576 divide by 2 and 3.
        TinyGeometry("kv6", heads=6, kv_heads=6, intermediate_size=384, vocab_size=576),
        TinyGeometry("kv2", heads=4, kv_heads=2),
        TinyGeometry("kv1", heads=4, kv_heads=1),
        # 4 layers: pipeline stages of 2 + 2, and 3 + 1 (VLLM_PP_LAYER_PARTITION).
        TinyGeometry("kv4-4layers", layers=4),
        # MLA: vLLM's CPU MLA backend takes DeepSeek's latent of 512 + 64 only.
        TinyGeometry("mla", arch="deepseek_v2"),
        # Layers 0 and 2 attend to a sliding window of 64 tokens, 1 and 3 to everything.
        TinyGeometry("sliding", arch="gemma3", layers=4),
        # Layer 0 a Mamba2 mixer (8 heads of 32, 2 groups: TP 2 splits them), layer 1
        # attention.
        TinyGeometry("hybrid", arch="granite_hybrid"),
    )
}


def train_tokenizer() -> object:
    """A byte-level BPE tokenizer trained on a fixed corpus (deterministic: one thread's
    merges over fixed text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(_CORPUS) * 4, trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer: object, out: Path, vocab_size: int | None = None) -> int:
    """`tokenizer.json` and a chat-free `tokenizer_config.json` in `out`, grown to
    `vocab_size` with added tokens `<extra_N>` when given; the vocabulary size."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    if vocab_size is not None:
        fast.add_tokens([f"<extra_{i}>" for i in range(vocab_size - len(fast))])
    fast.model_max_length = MAX_POSITIONS
    fast.save_pretrained(str(out))
    return len(fast)


# The MLA latent vLLM's CPU build serves (vllm/v1/attention/backends/mla/cpu_mla.py: "The
# current CPU decode kernel only compiles for this size"), and Gemma 3's window.
KV_LORA_RANK, QK_ROPE_HEAD_DIM = 512, 64
SLIDING_WINDOW = 64


def _common(vocab_size: int, eos_token_id: int, bos_token_id: int, g: TinyGeometry) -> dict:
    return {
        "vocab_size": vocab_size,
        "hidden_size": g.hidden_size,
        "intermediate_size": g.intermediate_size,
        "num_hidden_layers": g.layers,
        "num_attention_heads": g.heads,
        "num_key_value_heads": g.kv_heads,
        "max_position_embeddings": MAX_POSITIONS,
        "initializer_range": INITIALIZER_RANGE,
        "tie_word_embeddings": False,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def _qwen2(common: dict, g: TinyGeometry) -> object:
    from transformers import Qwen2Config

    return Qwen2Config(head_dim=g.head_dim, use_sliding_window=False, **common)


def _deepseek_v2(common: dict, g: TinyGeometry) -> object:
    """DeepSeek-V2's attention (no query LoRA), dense MLPs only (`first_k_dense_replace`
    covers every layer, so the routed experts are never built)."""
    from transformers import DeepseekV2Config

    return DeepseekV2Config(
        kv_lora_rank=KV_LORA_RANK,
        qk_rope_head_dim=QK_ROPE_HEAD_DIM,
        qk_nope_head_dim=g.head_dim,
        v_head_dim=g.head_dim,
        q_lora_rank=None,
        first_k_dense_replace=g.layers,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        **common,
    )


def _gemma3(common: dict, g: TinyGeometry) -> object:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        head_dim=g.head_dim,
        sliding_window=SLIDING_WINDOW,
        query_pre_attn_scalar=g.head_dim,
        layer_types=["sliding_attention", "full_attention"] * (g.layers // 2),
        **common,
    )


def _granite_hybrid(common: dict, g: TinyGeometry) -> object:
    """IBM Granite 4's hybrid: Mamba2 mixers and attention layers alternating, no experts."""
    from transformers import GraniteMoeHybridConfig

    return GraniteMoeHybridConfig(
        layer_types=["linear_attention", "full_attention"] * (g.layers // 2),
        num_local_experts=0,
        shared_intermediate_size=g.intermediate_size,
        mamba_n_heads=8,
        mamba_d_head=32,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_expand=2,
        mamba_d_conv=4,
        mamba_chunk_size=64,
        pad_token_id=0,
        position_embedding_type="rope",
        **common,
    )


# Each architecture's config and model class (transformers' names).
ARCHITECTURES = {
    "qwen2": (_qwen2, "Qwen2ForCausalLM"),
    "deepseek_v2": (_deepseek_v2, "DeepseekV2ForCausalLM"),
    "gemma3": (_gemma3, "Gemma3ForCausalLM"),
    "granite_hybrid": (_granite_hybrid, "GraniteMoeHybridForCausalLM"),
}


def model_config(
    vocab_size: int, eos_token_id: int, bos_token_id: int, geometry: TinyGeometry = DEFAULT
) -> object:
    """The transformers config of `geometry`'s architecture, float32."""
    build, _ = ARCHITECTURES[geometry.arch]
    return build(_common(vocab_size, eos_token_id, bos_token_id, geometry), geometry)


def make_tiny_model(out: Path, seed: int = SEED, geometry: TinyGeometry = DEFAULT) -> Path:
    """Write the tokenizer, config (of `geometry`) and random (seeded) float32 weights to
    `out`; returns it."""
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    vocab_size = save_tokenizer(tokenizer, out, geometry.vocab_size)
    config = model_config(
        vocab_size,
        eos_token_id=SPECIAL_TOKENS.index("</s>"),
        bos_token_id=SPECIAL_TOKENS.index("<s>"),
        geometry=geometry,
    )
    torch.manual_seed(seed)
    model_class = getattr(transformers, ARCHITECTURES[geometry.arch][1])
    model = model_class(config).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    _write_generation_config(out)
    return out


def _write_generation_config(out: Path) -> None:
    """Greedy by default, no sampling parameters vLLM would pick up from the model."""
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False}))


def vocabulary_size(model_dir: Path) -> int:
    """The model's vocabulary size, from its config."""
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def main() -> None:
    """Command line: `python -m kvxfer.testing.tiny_model OUT_DIR`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default=DEFAULT.name)
    args = parser.parse_args()
    print(make_tiny_model(args.out, args.seed, GEOMETRIES[args.geometry]))


if __name__ == "__main__":
    main()
