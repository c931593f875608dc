"""A tiny Qwen2-style model made here, for real `vllm serve` engines on a CPU machine.

Nothing comes from a model hub: a BPE tokenizer trained on a few sentences (`tokenizers`) and
a 2-layer Qwen2 config with random weights from a fixed seed (`transformers`), saved as a
directory that `vllm serve DIR` loads. The same seed gives the same weights, so greedy outputs
are deterministic. float32 weights: with bf16, near-ties between the first two choices flip
greedy tokens between engines that round differently.

    python scripts/tiny_model.py OUT_DIR

Geometry (chosen for kvxfer's e2e tests): 4 KV heads of head_dim 32, so TP 2 splits them 2 + 2;
`max_position_embeddings` 8192, so a ~4k-token prompt fits.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SEED = 1234
NUM_LAYERS = 2
HIDDEN_SIZE = 128
NUM_HEADS = 4
NUM_KV_HEADS = 4
HEAD_DIM = HIDDEN_SIZE // NUM_HEADS
INTERMEDIATE_SIZE = 256
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


def save_tokenizer(tokenizer: object, out: Path) -> int:
    """`tokenizer.json` and a chat-free `tokenizer_config.json` in `out`; the vocabulary size."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.model_max_length = MAX_POSITIONS
    fast.save_pretrained(str(out))
    return len(fast)


def model_config(vocab_size: int, eos_token_id: int, bos_token_id: int) -> object:
    """The Qwen2 config: 2 layers, 4 heads and 4 KV heads of 32, float32."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=INITIALIZER_RANGE,
        tie_word_embeddings=False,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        torch_dtype="float32",
        dtype="float32",
        use_sliding_window=False,
    )


def make_tiny_model(out: Path, seed: int = SEED) -> Path:
    """Write the tokenizer, config and random (seeded) float32 weights to `out`; returns it."""
    import torch
    from transformers import Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    vocab_size = save_tokenizer(tokenizer, out)
    config = model_config(
        vocab_size,
        eos_token_id=SPECIAL_TOKENS.index("</s>"),
        bos_token_id=SPECIAL_TOKENS.index("<s>"),
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
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
    """Command line: `python scripts/tiny_model.py OUT_DIR`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    print(make_tiny_model(args.out, args.seed))


if __name__ == "__main__":
    main()
