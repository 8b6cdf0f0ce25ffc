"""GGUF -> HF checkpoint conversion, on tiny GGUFs this file writes with the `gguf` package.

The GGUF is written from a tiny HF Llama the way llama.cpp's converter does it (q/k rows permuted,
byte-level BPE vocabulary in the metadata), so a faithful conversion must give back the same
logits, the same token ids and the same chat prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specpipe.checkpoint import convert_gguf, load_causal_lm, load_tokenizer, resolve_checkpoint
from specpipe.checkpoint import gguf_convert
from specpipe.checkpoint.gguf_convert import SOURCE_RECORD
from specpipe.errors import CheckpointError
from specpipe.testing.tiny import CHAT_TEMPLATE

TEXTS = ["def add(a, b):\n    return a + b", "Héllo wörld — 東京 🙂", "year 2024: 12345 items", "  two  spaces\n\n"]
MESSAGES = [{"role": "user", "content": "Write a function that adds 12 and 30."}]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """Each test gets its own specpipe cache, so conversions are never shared between tests."""
    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute: GGUF stores q/k rows interleaved per head.
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def write_llama_gguf(hf_dir: Path, out: Path, *, pad: bool = True, pre: str = "gpt2") -> Path:
    """Write the HF Llama checkpoint in `hf_dir` as an f32 GGUF with its byte-level BPE tokenizer."""
    import gguf
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    cfg = model.config
    vocab = tokenizer.get_vocab()
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    special_ids = set(tokenizer.all_special_ids)

    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(float(cfg.rope_theta))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in special_ids else gguf.TokenType.NORMAL for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    if pad:
        writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}  # fmt: skip
    layer_names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
                   "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}  # fmt: skip
    for name, tensor in model.state_dict().items():
        data = tensor.numpy().astype(np.float32)
        if name.startswith("model.layers."):
            index, rest = name[len("model.layers."):].split(".", 1)
            part = rest.removesuffix(".weight")
            if part == "self_attn.q_proj":
                data = _permute(data, cfg.num_attention_heads)
            elif part == "self_attn.k_proj":
                data = _permute(data, cfg.num_key_value_heads)
            name = f"blk.{index}.{layer_names[part]}.weight"
        else:
            name = names[name]
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def tiny_gguf(tiny_target, tmp_path_factory) -> Path:
    return write_llama_gguf(tiny_target, tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf")


def test_conversion_gives_back_the_same_model_and_tokenizer(tiny_gguf, tiny_target, cache):
    resolved = resolve_checkpoint(str(tiny_gguf))
    assert resolved.kind == "gguf" and resolved.source == str(tiny_gguf)
    assert resolved.path.parent == cache / "gguf"
    assert (resolved.path / "model.safetensors").is_file() and (resolved.path / "config.json").is_file()

    ids = torch.tensor([[0, 5, 17, 42, 99, 250, 7, 3]])
    with torch.no_grad():
        expected = load_causal_lm(tiny_target)(ids).logits
        converted = load_causal_lm(resolved.path)(ids).logits
    assert torch.allclose(converted, expected, atol=1e-4), (converted - expected).abs().max()

    original, rebuilt = load_tokenizer(tiny_target), load_tokenizer(resolved.path)
    for text in TEXTS:
        assert rebuilt.encode(text) == original.encode(text), text
        assert rebuilt.decode(rebuilt.encode(text)) == text
    assert rebuilt.get_vocab() == original.get_vocab()
    for name in ("bos", "eos", "pad"):
        assert getattr(rebuilt, f"{name}_token") == getattr(original, f"{name}_token"), name
    prompt = rebuilt.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt == original.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)

    config = json.loads((resolved.path / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (0, 1, 2)
    record = json.loads((resolved.path / SOURCE_RECORD).read_text())
    assert record["gguf_file"] == tiny_gguf.name and record["gguf_architecture"] == "llama"
    assert record["pad_token"] == "from tokenizer.ggml.padding_token_id"


def test_a_second_resolve_reuses_the_conversion(tiny_gguf, cache, monkeypatch):
    first = resolve_checkpoint(str(tiny_gguf))

    def must_not_run(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_convert, "_convert_into", must_not_run)
    second = resolve_checkpoint(str(tiny_gguf))
    assert second.path == first.path and second.weights_sha256 == first.weights_sha256
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == [first.path.name]  # no temp folders left


def test_a_conversion_parses_the_gguf_once(tiny_target, tmp_path, cache, monkeypatch):
    """transformers asks for a reader of the file for the config, the tokenizer and the weights; the conversion
    parses it once and hands the same reader to each (and the real reader is back afterwards)."""
    import gguf

    gguf_path = write_llama_gguf(tiny_target, tmp_path / "once.gguf")
    real, parses = gguf.GGUFReader, []

    def counting(path, mode="r"):
        parses.append(path)
        return real(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    folder = convert_gguf(gguf_path)
    assert (folder / "model.safetensors").is_file()
    assert len(parses) == 1, parses
    assert gguf.GGUFReader is counting
    with gguf_convert.parsed_once():
        first = gguf.GGUFReader(str(gguf_path))
        assert gguf.GGUFReader(str(tmp_path / "." / "once.gguf")) is first  # the same file by another spelling
    assert gguf.GGUFReader is counting and len(parses) == 2


def test_a_gguf_without_pad_token_stays_without_one(tiny_target, tmp_path, cache):
    gguf_path = write_llama_gguf(tiny_target, tmp_path / "nopad.gguf", pad=False)
    folder = convert_gguf(gguf_path)
    assert load_tokenizer(folder).pad_token is None
    assert json.loads((folder / "config.json").read_text()).get("pad_token_id") is None
    record = json.loads((folder / SOURCE_RECORD).read_text())
    assert record["pad_token"] is None


def test_the_gguf_pre_tokenizer_name_is_honoured(tiny_target, tmp_path, cache):
    # llama.cpp's "smollm" pre-tokenizer splits every digit; GPT-2's keeps runs of digits together.
    folder = convert_gguf(write_llama_gguf(tiny_target, tmp_path / "smollm-pre.gguf", pre="smollm"))
    tokenizer = load_tokenizer(folder)
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("12345")) == list("12345")
    assert tokenizer.decode(tokenizer.encode("year 2024")) == "year 2024"
    record = json.loads((folder / SOURCE_RECORD).read_text())
    assert any("smollm" in repair for repair in record["tokenizer_repairs"])


def test_a_corrupt_gguf_fails_cleanly(tmp_path, cache):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(CheckpointError, match="broken.gguf"):
        resolve_checkpoint(str(bad))
    assert not (cache / "gguf").exists() or not any((cache / "gguf").iterdir())
