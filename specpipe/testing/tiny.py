"""Make tiny random Llama checkpoints with a real byte-level BPE tokenizer.

Used by the test suite (tests/conftest.py) and usable from the command line to try specpipe without
downloading anything:  python -m specpipe.testing.tiny OUT_DIR [--seed N] [--vocab V]
"""

from __future__ import annotations

import argparse
from pathlib import Path

_CORPUS = (
    "def add(a, b):\n    return a + b\n\nclass Stack:\n    def push(self, x):\n        self.items.append(x)\n"
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens and the target verifies them.\n"
    "import numpy as np\nfor i in range(10):\n    print(i * i)\n"
    "Héllo wörld — naïve café, 東京, emoji 🙂 and more text to learn merges from.\n"
) * 4

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def make_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer: every string encodes, and multi-byte characters split across tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", clean_up_tokenization_spaces=False
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_llama(
    out_dir: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = 320,
    model_vocab_size: int | None = None,
    num_layers: int = 2,
    hidden_size: int = 64,
    tokenizer=None,
) -> Path:
    """Save a random LlamaForCausalLM + tokenizer as a normal HF checkpoint (safetensors) in `out_dir`.

    `model_vocab_size` > tokenizer vocab makes padded embedding rows (the Qwen case). The init scale is
    larger than usual so next-token distributions are peaked: greedy ties are rare and sampling tests
    see structure, as with a trained model.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer or make_tokenizer(vocab_size)
    vocab = len(tokenizer)
    config = LlamaConfig(
        vocab_size=model_vocab_size or vocab,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.15,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=320)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    print(make_tiny_llama(args.out_dir, seed=args.seed, vocab_size=args.vocab, num_layers=args.layers))


if __name__ == "__main__":
    main()
