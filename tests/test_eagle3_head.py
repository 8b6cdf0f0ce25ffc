"""EAGLE-3 heads: features from the teacher pass, training-time test = drafting, upstream's checkpoint format.

`_TrtLlmStyleHead` below is a loader written from TensorRT-LLM's key names and forward
(tensorrt_llm/_torch/models/modeling_speculative.py @b35ac1b6, Eagle3DecoderLayer / Eagle3DraftModel, and
Eagle3ForCausalLM.load_weights: "model." + every key but lm_head; q/k/v fused on load), drafting token by token
with a KV cache as a serving engine does. It shares no code with specpipe/distill/eagle3.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from specpipe.distill.config import DistillConfig

# TensorRT-LLM's module tree of an Eagle3 draft model, after load_weights' "model." prefix (lm_head stays top-level).
TRTLLM_KEYS = {
    "model.fc.weight", "model.midlayer.input_layernorm.weight", "model.midlayer.hidden_norm.weight",
    "model.midlayer.self_attn.qkv_proj.weight", "model.midlayer.self_attn.o_proj.weight",
    "model.midlayer.post_attention_layernorm.weight", "model.midlayer.mlp.gate_proj.weight",
    "model.midlayer.mlp.up_proj.weight", "model.midlayer.mlp.down_proj.weight", "model.norm.weight", "model.d2t",
    "lm_head.weight",
}  # fmt: skip


class _TrtLlmStyleHead:
    def __init__(self, folder: Path, target_embedding: torch.Tensor):
        from safetensors.torch import load_file

        self.config = json.loads((folder / "config.json").read_text())
        raw = load_file(str(folder / "model.safetensors"))
        assert "embed_tokens.weight" not in raw and not any("embed_tokens" in k for k in raw)
        weights = {}
        for key, value in raw.items():
            if key == "t2d":
                continue  # vLLM and SGLang skip it; TensorRT-LLM has no module for it
            weights[key if "lm_head" in key else "model." + key] = value.float() if value.is_floating_point() else value
        prefix = "model.midlayer.self_attn."
        weights[prefix + "qkv_proj.weight"] = torch.cat([weights.pop(prefix + f"{n}_proj.weight") for n in "qkv"])
        assert set(weights) == TRTLLM_KEYS, set(weights) ^ TRTLLM_KEYS
        self.w, self.embedding = weights, target_embedding.float()
        c = self.config
        self.heads, self.kv_heads, self.head_dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.eps, self.theta = c["rms_norm_eps"], c["rope_theta"]
        assert weights["lm_head.weight"].shape[0] == c["draft_vocab_size"] == weights["model.d2t"].shape[0]
        self.keys, self.values = [], []  # the draft layer's KV cache: one entry per position

    def _norm(self, x, name):
        return self.w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def _rope(self, x, position):  # x [heads, d]
        inv = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        angles = torch.cat([position * inv, position * inv])
        half = self.head_dim // 2
        return x * angles.cos() + torch.cat([-x[:, half:], x[:, :half]], -1) * angles.sin()

    def step(self, token: int, hidden: torch.Tensor, position: int):
        """One drafted position: (logits over the target vocabulary with -inf outside the draft vocabulary, state)."""
        w, mid = self.w, "model.midlayer."
        if hidden.shape[-1] != self.config["hidden_size"]:
            hidden = w["model.fc.weight"] @ hidden  # apply_eagle3_fc: only on target features
        residual = hidden
        x = torch.cat([self._norm(self.embedding[token], mid + "input_layernorm.weight"),
                       self._norm(hidden, mid + "hidden_norm.weight")])
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = (w[mid + "self_attn.qkv_proj.weight"] @ x).split([q_size, kv_size, kv_size])
        q = self._rope(q.view(self.heads, -1), position)
        self.keys.append(self._rope(k.view(self.kv_heads, -1), position))
        self.values.append(v.view(self.kv_heads, -1))
        keys = torch.stack(self.keys, 1).repeat_interleave(self.heads // self.kv_heads, 0)  # [heads, t, d]
        values = torch.stack(self.values, 1).repeat_interleave(self.heads // self.kv_heads, 0)
        attn = torch.softmax((keys @ q[:, :, None])[..., 0] / math.sqrt(self.head_dim), -1)  # [heads, t]
        out = (attn[:, None, :] @ values)[:, 0].reshape(-1)
        residual = residual + w[mid + "self_attn.o_proj.weight"] @ out
        x = self._norm(residual, mid + "post_attention_layernorm.weight")
        state = residual + w[mid + "mlp.down_proj.weight"] @ (
            torch.nn.functional.silu(w[mid + "mlp.gate_proj.weight"] @ x) * (w[mid + "mlp.up_proj.weight"] @ x))
        draft_logits = w["lm_head.weight"] @ self._norm(state, "model.norm.weight")
        logits = torch.full((self.config["vocab_size"],), float("-inf"))
        d2t = w["model.d2t"]
        logits[torch.arange(len(d2t)) + d2t] = draft_logits  # vLLM: targets = arange(draft_vocab_size) + d2t
        return logits, state


@pytest.fixture(scope="module")
def eight_layer_target(tmp_path_factory, tiny_tokenizer):
    from specpipe.testing.tiny import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("eight") / "ckpt", seed=2, num_layers=8, tokenizer=tiny_tokenizer)


def _cfg(target: Path, out: Path, **overrides) -> DistillConfig:
    values = dict(target=str(target), out=out, kind="eagle3", minutes=5, answer_tokens=1000, train_tokens=8000,
                  answer_batch=16, max_answer_tokens=16, batch_tokens=256, head_vocab=96, checkpoint_every=1000,
                  teacher_dtype="float32", train_dtype="float32", ttt_steps=3)
    return DistillConfig(**{**values, **overrides})


@pytest.fixture(scope="module")
def trained_head(eight_layer_target, tmp_path_factory):
    import os

    from specpipe.distill import distill

    root = tmp_path_factory.mktemp("eagle3")
    old = os.environ.get("SPECPIPE_CACHE")
    os.environ["SPECPIPE_CACHE"] = str(root / "cache")
    try:
        return distill(_cfg(eight_layer_target, root / "head"))
    finally:
        if old is None:
            os.environ.pop("SPECPIPE_CACHE")
        else:
            os.environ["SPECPIPE_CACHE"] = old


def test_teacher_pass_records_the_residual_stream(eight_layer_target, tiny_tokenizer):
    """Features kept while answering a left-padded batch equal a fresh forward pass over each whole sequence."""
    from transformers import AutoModelForCausalLM

    from specpipe.distill.teacher import answer_prompts

    model = AutoModelForCausalLM.from_pretrained(eight_layer_target).eval()
    prompts = [tiny_tokenizer("def add(a, b):")["input_ids"], tiny_tokenizer("The quick brown fox jumps")["input_ids"]]
    sequences = answer_prompts(model, prompts, kinds=["code", "chat"], max_new_tokens=6, eos_token_ids=set(),
                               pad_token_id=tiny_tokenizer.pad_token_id, top_k=4, feature_layers=(1, 3, 4))
    for seq in sequences:
        assert seq.features.shape == (len(seq) - 1, 3 * model.config.hidden_size)
        with torch.no_grad():
            states = model(seq.token_ids[None], output_hidden_states=True).hidden_states
        expected = torch.cat([states[i + 1][0, :-1] for i in (1, 3, 4)], -1)
        scale = float(expected.abs().max())
        assert float((seq.features.float() - expected).abs().max()) <= 2e-3 * max(1.0, scale)  # float16 storage


def test_a_deadline_cuts_answers_where_they_are(eight_layer_target, tiny_tokenizer):
    """The teacher pass's time cap holds inside a batch: past the deadline every answer stops, as far as it got (one
    token here, the deadline being already past), with its distributions and features still lined up."""
    from transformers import AutoModelForCausalLM

    from specpipe.distill.teacher import answer_prompts

    model = AutoModelForCausalLM.from_pretrained(eight_layer_target).eval()
    prompts = [tiny_tokenizer("def add(a, b):")["input_ids"], tiny_tokenizer("The quick brown fox jumps")["input_ids"]]
    common = dict(kinds=["code", "chat"], max_new_tokens=6, eos_token_ids=set(), pad_token_id=tiny_tokenizer.pad_token_id,
                  top_k=4, feature_layers=(1, 3, 4))
    full = answer_prompts(model, prompts, **common)
    cut = answer_prompts(model, prompts, **common, deadline=0.0)
    for whole, part, ids in zip(full, cut, prompts):
        assert len(whole) == len(ids) + 6 and len(part) == len(ids) + 1
        assert torch.equal(part.token_ids, whole.token_ids[: len(part)])  # the same answer, cut
        assert part.top_ids.shape[0] == part.features.shape[0] == len(part) - 1


def test_training_time_test_is_what_drafting_computes(eight_layer_target, tmp_path):
    """The unrolled training pass gives, at every row and step, the state and logits that drafting token by token
    with a KV cache gives (the upstream-style loader above), and the head round-trips through the file format."""
    from transformers import AutoModelForCausalLM

    from specpipe.checkpoint.eagle3 import head_config, write_eagle3_head
    from specpipe.distill.eagle3 import make_head, valid_rows

    target = AutoModelForCausalLM.from_pretrained(eight_layer_target).eval()
    torch.manual_seed(0)
    vocab_ids = torch.sort(torch.randperm(target.config.vocab_size)[:64]).values
    head = make_head(target, feature_layers=(1, 3, 4), draft_token_ids=vocab_ids,
                     warm_start=False, warm_attention=False, seed=1).eval()
    with torch.no_grad():  # random norms too, so a swapped norm would show
        for name, p in head.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    n, steps, hidden = 7, 3, target.config.hidden_size
    features = torch.randn(1, n, 3 * hidden) * 3
    tokens = torch.randint(0, target.config.vocab_size, (1, n + steps - 1))
    with torch.no_grad():
        states = head.unrolled(features, tokens, valid_rows(torch.tensor([n]), n), steps)
    folder = write_eagle3_head(tmp_path, head.state_dict(), head_config(head.shape))
    for row in range(n):
        loaded = _TrtLlmStyleHead(folder, target.get_input_embeddings().weight.detach())
        for context in range(row + 1):  # the context: rows 0..row from target features
            logits, state = loaded.step(int(tokens[0, context]), features[0, context], position=context)
        for step in range(steps):
            if step:  # drafting: one position further on the head's own state
                logits, state = loaded.step(int(tokens[0, row + step]), state, position=row + step)
            assert torch.allclose(state, states[step][0, row], atol=1e-4, rtol=1e-4), (row, step)
            mine = torch.full_like(logits, float("-inf"))
            mine[vocab_ids] = head.logits(states[step][0, row]).detach()
            assert torch.allclose(logits[vocab_ids], mine[vocab_ids], atol=1e-4, rtol=1e-4)
            assert torch.isinf(logits).sum() == target.config.vocab_size - len(vocab_ids)


def test_distill_writes_an_upstream_eagle3_head(trained_head, eight_layer_target):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from specpipe.checkpoint.eagle3 import load_eagle3_tensors, read_eagle3_head
    from specpipe.engines import upstream

    out = trained_head.path
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "distill.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    target = AutoConfig.from_pretrained(eight_layer_target)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["tie_word_embeddings"] is False
    assert config["draft_vocab_size"] == 96 and config["vocab_size"] == target.vocab_size
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # default for 8 layers
    assert "eagle_aux_hidden_state_layer_ids" not in config  # vLLM would read a top-level key one layer off
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == set(upstream.EAGLE3_HEAD_TENSORS)
    assert tensors["fc.weight"].shape == (target.hidden_size, 3 * target.hidden_size)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * target.hidden_size
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and int(t2d.sum()) == 96
    assert torch.equal(torch.nonzero(t2d)[:, 0], torch.arange(96) + d2t)  # the two maps agree
    head = read_eagle3_head(str(out))
    assert head.layers_to_capture == (1, 3, 4) and head.draft_vocab_size == 96
    assert set(load_eagle3_tensors(out)) == set(upstream.EAGLE3_HEAD_TENSORS)
    _TrtLlmStyleHead(out, torch.zeros(target.vocab_size, target.hidden_size))  # loads: key names and shapes


def test_head_training_learns(trained_head):
    record = trained_head.record
    history = record["training"]["history"]
    assert record["kind"] == "eagle3" and record["training"]["steps"] > 0
    assert history[-1][2] < history[0][2], history  # smoothed loss falls
    assert record["held_out_agreement"] is not None and len(record["held_out_agreement_by_step"]) == 3
    assert record["data"]["held_out"] > 0


def assert_draft_cost_is_the_steps_ratio(costs: dict, ms: dict) -> None:
    """costs["draft"] is the head's step over the target's, within what the record's rounding allows: each step is
    rounded to 1 us (distill/verdict.py) and the cost to 4 decimals. The tiny models' steps are a fraction of a
    millisecond, so on a fast CPU the rounding alone moves their ratio by more than 1% (seen on a Zen 5: 0.4099
    recorded beside 0.049 / 0.121 = 0.405)."""
    draft, target, half_us = ms["draft_step_ms"], ms["target_step_ms"], 0.0005
    low, high = (draft - half_us) / (target + half_us), (draft + half_us) / (target - half_us)
    assert low - 5e-5 <= costs["draft"] <= high + 5e-5, (costs, ms)


def test_verdict_times_the_engines_that_will_run(trained_head):
    """The head's verdict predicts with the target's ONNX Runtime engine and the head's CPU engine, timed here."""
    verdict = trained_head.record["verdict"]
    assert verdict["predicted_speedup"] is not None, verdict
    ms = verdict["step_ms"]
    assert ms["target_step_ms"] > 0 and ms["draft_step_ms"] > 0
    assert_draft_cost_is_the_steps_ratio(verdict["step_costs"], ms)
    assert "ONNX Runtime" in verdict["measured_with"] and "EAGLE-3 head" in verdict["measured_with"]
    # the acceptance decoding will see: the head, and prompt lookup where it is unsure (speculative/eagle3.py)
    chain, alone = trained_head.record["held_out_chain_with_lookup"], trained_head.record["held_out_chain"]
    assert chain["anchors"] == alone["anchors"] > 0
    assert verdict["agreement"] == pytest.approx(chain["conditional"][0], abs=1e-4)


def test_verdict_predicts_against_each_target_precision(trained_head, eight_layer_target):
    """A quantized target steps faster and the head does not, so the verdict times the target at every precision it
    is asked for, leads with the least prediction and names the others."""
    from specpipe.distill.verdict import measured_verdict, verdict_line
    from specpipe.engines.eagle3_head import HEAD_DTYPES

    v = measured_verdict(0.5, eight_layer_target, threads=1, head=trained_head.path, feature_layers=(1, 3, 4),
                         quants=("none", "int8-wo"))
    by_quant = v["by_target_quant"]
    assert set(by_quant) == {"none", "int8-wo"}
    for quant, one in by_quant.items():
        assert one["target_quant"] == quant and one["step_ms"]["target_step_ms"] > 0
        assert one["step_ms"]["head_dtype"] in HEAD_DTYPES  # the runtime build would run it in
        assert_draft_cost_is_the_steps_ratio(one["step_costs"], one["step_ms"])
    assert v["predicted_speedup"] == min(one["predicted_speedup"] for one in by_quant.values())
    assert "int8-wo" in by_quant["int8-wo"]["measured_with"] and "fp32" in by_quant["none"]["measured_with"]
    line = verdict_line(v)
    other = "fp32" if v["target_quant"] == "int8-wo" else "int8-wo"
    assert f"against the {'int8-wo' if v['target_quant'] == 'int8-wo' else 'fp32'} target" in line and other in line


@pytest.mark.timing  # its curve is a ratio of times decoding took
def test_verdict_times_the_verify_calls_decoding_pays(trained_head, eight_layer_target, tiny_tokenizer):
    """Given held-out prompts, the verdict decodes them with the target alone and with the head, and its verify curve
    is each call's median over the target alone's 1-token steps where decoding made enough of them (the timed point
    elsewhere), as the build's sample bench records it; the curve timed alone is kept beside it."""
    from specpipe.distill.verdict import DECODE_PROMPTS, measured_verdict, verdict_line
    from specpipe.engines.timing import MIN_CALLS
    from specpipe.testing.curves import curve_from_calls

    prompts = [tiny_tokenizer(text)["input_ids"] for text in
               ("def add(a, b):", "The quick brown fox", "for i in range(10):", "Once upon a time", "import os")]
    v = measured_verdict(0.5, eight_layer_target, threads=1, head=trained_head.path, feature_layers=(1, 3, 4),
                         prompts=prompts, tokenizer=tiny_tokenizer, eos_token_ids=[10**6])  # no EOS: every token runs
    decoded, timed = v["step_ms"]["decoded"], v["step_ms"]["verify_timed"]
    assert decoded["prompts"] == DECODE_PROMPTS < len(prompts)
    calls = decoded["calls"]
    assert calls["1"][0] >= MIN_CALLS  # the target alone's 1-token steps, the unit
    # rel: the recorded medians are rounded to 1e-4 ms (calls_summary), ~0.1% of a tiny model's call
    assert v["step_costs"]["verify"] == pytest.approx(curve_from_calls(calls, timed), rel=3e-3)
    assert decoded["verify"] == pytest.approx(v["step_costs"]["verify"], abs=1e-4)
    # adaptive K drafts at least one token a step (the head's acceptance here is near 0, so mostly one): the curve's
    # first point comes from decoding, not from the timing alone
    assert calls.get("2", [0])[0] >= MIN_CALLS
    line = verdict_line(v)
    assert "as decoding 4 held-out prompts paid them" in line
    assert f"they decoded at {decoded['speedup']:.2f}x, acceptance {decoded['acceptance']:.2f}" in line


def test_verdict_exports_the_target_at_the_precision_build_makes(eight_layer_target, tmp_path):
    """The verdict's int8-wo target is build's: MatMulNBits weights (quantize/weight_only.BUILDER_RECIPES), and it
    still outputs the head's features."""
    import onnx

    from specpipe.distill.verdict import export_engine
    from specpipe.engines.base import read_engine_meta

    out = export_engine(eight_layer_target, tmp_path / "int8", feature_layers=(1, 3, 4), quant="int8-wo")
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    assert any(node.op_type == "MatMulNBits" for node in graph.node)
    assert "aux_hidden_states" in [o.name for o in graph.output]
    assert read_engine_meta(out)["quant"] == "int8-wo"
    with pytest.raises(ValueError, match="fp8"):
        export_engine(eight_layer_target, tmp_path / "fp8", quant="fp8")


def test_init_head_trains_a_written_head_further(trained_head, eight_layer_target, tmp_path, monkeypatch):
    """--init-head starts from every tensor of a written head, its draft vocabulary included (its d2t, not one
    counted from this run's data), and a head for other target layers is refused in one line."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from specpipe.distill import distill
    from specpipe.distill.eagle3 import load_head_weights, make_head
    from specpipe.errors import UsageError

    written = load_file(str(trained_head.path / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(eight_layer_target).eval()
    fresh = make_head(model, feature_layers=(1, 3, 4), draft_token_ids=torch.arange(96),
                      warm_start=True, warm_attention=False, seed=5)
    load_head_weights(fresh, trained_head.path)
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, written[name].to(tensor.dtype)), name
    other = make_head(model, feature_layers=(1, 2, 4), draft_token_ids=torch.arange(96),
                      warm_start=True, warm_attention=False, seed=5)
    with pytest.raises(UsageError, match="target layers"):
        load_head_weights(other, trained_head.path)

    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path / "cache"))
    with monkeypatch.context() as patched:  # a folder that is not a head is refused before the teacher pass
        patched.setattr("specpipe.distill.run._teacher_data", lambda *a, **k: pytest.fail("teacher pass ran"))
        with pytest.raises(UsageError, match="init-head"):
            distill(_cfg(eight_layer_target, tmp_path / "bad", init_head=tmp_path / "not-a-head"))
    result = distill(_cfg(eight_layer_target, tmp_path / "further", init_head=trained_head.path, head_vocab=64,
                          train_tokens=2000))
    assert result.record["training"]["init_head"] == str(trained_head.path)
    assert result.record["draft"]["draft_vocab_size"] == 96  # the loaded head's, not --head-vocab's
    further = load_file(str(result.path / "model.safetensors"))
    assert torch.equal(further["d2t"], written["d2t"]) and torch.equal(further["t2d"], written["t2d"])
    assert not torch.equal(further["fc.weight"], written["fc.weight"].to(further["fc.weight"].dtype))  # it trained


def test_writer_refuses_an_embedding_or_a_missing_key(tmp_path):
    from specpipe.checkpoint.eagle3 import write_eagle3_head
    from specpipe.engines import upstream

    tensors = {name: torch.zeros(2, 2) for name in upstream.EAGLE3_HEAD_TENSORS}
    with pytest.raises(ValueError, match="embed_tokens"):
        write_eagle3_head(tmp_path, {**tensors, "embed_tokens.weight": torch.zeros(2, 2)}, {})
    del tensors["d2t"]
    with pytest.raises(ValueError, match="d2t"):
        write_eagle3_head(tmp_path, tensors, {})


def test_eagle3_refuses_stdlib_data_and_bad_layers(eight_layer_target, tmp_path, monkeypatch):
    from specpipe.distill import distill
    from specpipe.errors import UsageError

    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(UsageError, match="answers"):
        distill(_cfg(eight_layer_target, tmp_path / "a", data=["answers", "stdlib"]))
    with pytest.raises(UsageError, match="feature-layers"):
        distill(_cfg(eight_layer_target, tmp_path / "b", feature_layers=[1, 7]))


@pytest.mark.gpu
def test_head_trains_on_cuda(eight_layer_target, tmp_path, monkeypatch):
    """About a minute on a GPU: answers and training on CUDA; the loss falls."""
    from specpipe.distill import distill

    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path / "cache"))
    result = distill(_cfg(eight_layer_target, tmp_path / "head", device="cuda", answer_tokens=4000,
                          train_tokens=400_000, minutes=3, batch_tokens=2048))
    record = result.record
    assert record["device"].startswith("cuda")
    history = record["training"]["history"]
    assert len(history) >= 3 and history[-1][2] < 0.9 * history[0][2], history


def test_cli_distill_kind_eagle3(eight_layer_target, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from specpipe.cli import cli

    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path / "cache"))
    result = CliRunner().invoke(cli, [
        "distill", "--target", str(eight_layer_target), "--out", str(tmp_path / "head"), "--kind", "eagle3",
        "--answer-tokens", "300", "--train-tokens", "1500", "--answer-batch", "16", "--max-answer-tokens", "12",
        "--batch-tokens", "256", "--head-vocab", "64", "--feature-layers", "1,2,5", "--ttt-steps", "2",
        "--no-warm-start", "--teacher-dtype", "float32", "--train-dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert "by drafted position" in result.output
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 5] and config["draft_vocab_size"] == 64
    record = json.loads((tmp_path / "head" / "distill.json").read_text())
    assert record["training"]["ttt_steps"] == 2 and record["training"]["warm_start"] is False
    assert record["verdict"]["predicted_speedup"] is not None  # timed here by default


def test_cli_distill_kind_eagle3_no_verdict(eight_layer_target, tmp_path, monkeypatch):
    """--no-verdict: the head is written, no engine is timed, and the summary says the speedup was not predicted."""
    from click.testing import CliRunner

    import specpipe.distill.verdict as verdict_module
    from specpipe.cli import cli

    def refuse(*args, **kwargs):
        raise AssertionError("timed an engine under --no-verdict")

    monkeypatch.setattr(verdict_module, "measured_verdict", refuse)
    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path / "cache"))
    result = CliRunner().invoke(cli, [
        "distill", "--target", str(eight_layer_target), "--out", str(tmp_path / "head"), "--kind", "eagle3",
        "--answer-tokens", "300", "--train-tokens", "1500", "--answer-batch", "16", "--max-answer-tokens", "12",
        "--batch-tokens", "256", "--head-vocab", "64", "--feature-layers", "1,2,5", "--ttt-steps", "2",
        "--teacher-engine", "torch", "--teacher-dtype", "float32", "--train-dtype", "float32", "--no-verdict"])
    assert result.exit_code == 0, result.output
    assert "not timed here (--no-verdict)" in result.output
    record = json.loads((tmp_path / "head" / "distill.json").read_text())
    assert record["verdict"]["predicted_speedup"] is None and record["config"]["verdict"] is False
    assert (tmp_path / "head" / "model.safetensors").is_file()
