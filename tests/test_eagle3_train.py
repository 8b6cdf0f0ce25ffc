"""Training an EAGLE-3 head: what the loss is taught (distill/eagle3_train.py) and the curve's bookkeeping."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def tiny_model(tiny_target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target).eval()


def _sequence(length: int, top_ids: torch.Tensor, hidden: int, seed: int):
    from specpipe.distill.teacher import TeacherSequence

    g = torch.Generator().manual_seed(seed)
    k = top_ids.shape[1]
    return TeacherSequence(token_ids=torch.randint(0, 200, (length,), generator=g), top_ids=top_ids.int(),
                           top_logprobs=torch.log_softmax(torch.randn(length - 1, k, generator=g), -1).half(),
                           prompt_len=0, kind="code", features=torch.randn(length - 1, 3 * hidden, generator=g).half())


def _trainer(tiny_model, sequences, tmp_path, vocab_ids, prompt_weight: float = 1.0):
    from specpipe.distill.eagle3 import make_head
    from specpipe.distill.eagle3_train import HeadTrainer

    head = make_head(tiny_model, feature_layers=(0, 1, 1), draft_token_ids=vocab_ids,
                     warm_start=True, warm_attention=False, seed=0)
    # negatives >= the draft vocabulary: every draft token is scored, so the loss does not depend on the batch's ids
    return HeadTrainer(head, sequences, steps=2, decay=0.8, budget_s=60, lr=1e-3, batch_tokens=512, negatives=10**6,
                       prompt_weight=prompt_weight, seed=0, state_path=tmp_path / "state.pt", checkpoint_every=1000)


def test_a_position_whose_teacher_tokens_are_all_outside_the_draft_vocabulary_teaches_nothing(tiny_model, tmp_path):
    """Such a position has no target distribution over the draft vocabulary to learn: it must add no loss (it once
    taught draft token 0, where every out-of-vocabulary id was clamped)."""
    hidden, vocab = tiny_model.config.hidden_size, tiny_model.config.vocab_size
    vocab_ids = torch.arange(0, 64)
    outside = torch.randint(100, vocab, (11, 4), generator=torch.Generator().manual_seed(3))
    inside = torch.randint(0, 64, (11, 4), generator=torch.Generator().manual_seed(4))
    unteachable, ordinary = _sequence(12, outside, hidden, 1), _sequence(12, inside, hidden, 2)
    trainer = _trainer(tiny_model, [unteachable, ordinary], tmp_path, vocab_ids)
    both, _, _ = trainer._loss([unteachable, ordinary], "float32")
    alone, _, _ = trainer._loss([ordinary], "float32")
    assert torch.allclose(both, alone, rtol=1e-4, atol=1e-5), (float(both), float(alone))


def test_prompt_positions_weigh_the_prompt_weight(tiny_model, tmp_path):
    """A prompt position's loss weighs prompt_weight against an answer position's 1 (the shared chat prefix 0): at 0
    the target's distributions over a prompt's tokens teach the head nothing, at 1 as much as an answer's."""
    from dataclasses import replace

    from specpipe.distill.eagle3_train import collate_head
    from specpipe.distill.train import _collate

    hidden = tiny_model.config.hidden_size
    seqs = [_prompted(30, 10, hidden, 1), _prompted(24, 6, hidden, 2)]
    # teacher row r is the distribution over token r+1: rows 0..prompt_len-2 teach prompt tokens, then the answer's
    *_, weights = collate_head(seqs, 0, 2, prompt_weight=0.5)
    assert weights[0, :9].eq(0.5).all() and weights[0, 9:29].eq(1.0).all() and weights[0, 29:].eq(0.0).all()
    assert weights[1, :5].eq(0.5).all() and weights[1, 5:23].eq(1.0).all() and weights[1, 23:].eq(0.0).all()
    *_, prefixed = collate_head(seqs, 3, 2, prompt_weight=0.5)
    assert prefixed[:, :3].eq(0.0).all() and prefixed[0, 3:9].eq(0.5).all()
    *_, model_weights = _collate(seqs, 0, 0.25)  # the model draft's batches follow the same rule
    assert model_weights[0, :9].eq(0.25).all() and model_weights[0, 9:29].eq(1.0).all()

    # the trainer uses its prompt_weight: other target distributions over the prompts change the loss unless it is 0
    def scrambled(seq):
        rows = seq.prompt_len - 1
        return replace(seq, top_logprobs=torch.cat([seq.top_logprobs[:rows].flip(-1), seq.top_logprobs[rows:]]))

    vocab_ids = torch.arange(0, 64)
    for weight in (0.0, 1.0):
        trainer = _trainer(tiny_model, seqs, tmp_path, vocab_ids, prompt_weight=weight)
        same = torch.isclose(trainer._loss(seqs, "float32")[0], trainer._loss([scrambled(q) for q in seqs], "float32")[0])
        assert bool(same) == (weight == 0.0), weight


class _Oracle(torch.nn.Module):
    """A 'model draft' whose argmax at row t is the target's greedy token exactly where `right(t)` says."""

    def __init__(self, sequence, vocab: int, right):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.sequence, self.vocab, self.right = sequence, vocab, right

    def forward(self, input_ids):
        from types import SimpleNamespace

        top = self.sequence.top_ids[:, 0].long()
        logits = torch.zeros(1, len(top) + 1, self.vocab)
        for t, token in enumerate(top):
            logits[0, t, int(token) if self.right(t) else (int(token) + 1) % self.vocab] = 1.0
        return SimpleNamespace(logits=logits)


def _prompted(length: int, prompt_len: int, hidden: int, seed: int):
    from specpipe.distill.teacher import TeacherSequence

    g = torch.Generator().manual_seed(seed)
    return TeacherSequence(token_ids=torch.randint(0, 200, (length,), generator=g),
                           top_ids=torch.randint(0, 64, (length - 1, 4), generator=g).int(),
                           top_logprobs=torch.log_softmax(torch.randn(length - 1, 4, generator=g), -1).half(),
                           prompt_len=prompt_len, kind="code",
                           features=torch.randn(length - 1, 3 * hidden, generator=g).half())


def test_chain_acceptance_counts_answer_rows_and_conditions_on_the_chain():
    """Right at every even row: position 1 agrees half the time, and a chain never gets two in a row."""
    from specpipe.distill.acceptance import model_chain_hits

    seq = _prompted(30, 10, 8, 0)
    summary = model_chain_hits(_Oracle(seq, 320, lambda t: t % 2 == 0), [seq]).summary()
    # anchors: teacher rows 9 (first answer token) .. 26 (position 3 reads row 28, the last one)
    assert summary["anchors"] == 18
    assert summary["agreement"] == [0.5, 0.5, 0.5] and summary["conditional"][:2] == [0.5, 0.0]
    assert summary["accepted_len"] == 0.5
    perfect = model_chain_hits(_Oracle(seq, 320, lambda t: True), [seq]).summary()
    assert perfect["conditional"] == [1.0, 1.0, 1.0] and perfect["accepted_len"] == 3.0
    late = model_chain_hits(_Oracle(seq, 320, lambda t: t >= 9), [seq]).summary()  # prompt rows do not count
    assert late["agreement"] == [1.0, 1.0, 1.0]


def test_head_chain_hits_read_the_unrolled_step_of_the_row_before(tiny_model):
    """Position k from anchor a (teacher row a predicts token a+1) is step k-1 of head row a-1, compared with
    teacher row a+k-1: checked against a direct reading of the unrolled states."""
    from specpipe.distill.acceptance import head_chain_hits
    from specpipe.distill.eagle3 import make_head, valid_rows

    hidden = tiny_model.config.hidden_size
    head = make_head(tiny_model, feature_layers=(0, 1, 1), draft_token_ids=torch.arange(64),
                     warm_start=True, warm_attention=False, seed=0)
    seq = _prompted(40, 6, hidden, 5)
    n = len(seq) - 1
    with torch.no_grad():
        tokens = torch.cat([seq.token_ids[1:], torch.zeros(2, dtype=torch.long)])[None]
        states = head.unrolled(seq.features[None].float(), tokens, valid_rows(torch.tensor([n]), n), 3)
        # the target's greedy token at row r is what step 0 of head row r-1 drafts: position 1 is always right
        seq.top_ids[1:, 0] = head.logits(states[0][0, :-1]).argmax(-1).int()
    expected = [[int(head.logits(states[k][0, a - 1]).argmax()) == int(seq.top_ids[a + k, 0]) for a in range(5, 37)]
                for k in range(3)]
    hits = head_chain_hits(head, [seq]).hits
    assert hits.tolist() == expected and bool(hits[0].all())


def test_head_chain_hits_with_lookup_take_the_copy_where_the_head_is_unsure(tiny_model):
    """As the decoder drafts (speculative/eagle3.py): an anchor where the head's top probability is under the threshold
    and prompt lookup matches the tokens so far takes the copy's hits at every position; elsewhere the head's. The
    answer repeats itself from token 20 on (ids[k] = ids[k-14]) and the target's greedy token is the next one, so
    there every copy is right."""
    from specpipe.distill.acceptance import head_chain_hits
    from specpipe.distill.eagle3 import make_head
    from specpipe.speculative.ngram import NgramDrafter

    head = make_head(tiny_model, feature_layers=(0, 1, 1), draft_token_ids=torch.arange(64),
                     warm_start=True, warm_attention=False, seed=0)
    seq = _prompted(40, 6, tiny_model.config.hidden_size, 5)
    for k in range(20, len(seq)):
        seq.token_ids[k] = seq.token_ids[k - 14]
    seq.top_ids[:, 0] = seq.token_ids[1:].int()
    alone = head_chain_hits(head, [seq]).hits
    assert torch.equal(head_chain_hits(head, [seq], lookup_below=1e-9).hits, alone)  # never unsure: the head's
    looked = head_chain_hits(head, [seq], lookup_below=1.0).hits  # always unsure: the copy wherever there is one
    ids = seq.token_ids.tolist()
    for a in range(looked.shape[1]):
        r = 5 + a  # teacher row r scores token r + 1; the context is ids[: r + 1]
        copy = NgramDrafter().new_request().propose(ids[: r + 1], 3, None, None).tokens
        expected = [k < len(copy) and copy[k] == ids[r + 1 + k] for k in range(3)] if copy else alone[:, a].tolist()
        assert looked[:, a].tolist() == expected, a
        if r >= 22:
            assert bool(looked[:, a].all()), (a, copy)
    assert head_chain_hits(head, [seq], lookup_below=1.0).summary()["conditional"][0] > alone.float().mean(1)[0]


def test_head_chain_hits_alone_and_with_lookup_from_one_unroll_equal_the_two_scorings(tiny_model):
    """The distillation's closing record scores the head alone and with prompt lookup from one unroll: both equal
    what head_chain_hits gives for each (and the lookup's copies do not leak into the head's own hits)."""
    from specpipe.distill.acceptance import head_chain_hits, head_chain_hits_alone_and_with_lookup
    from specpipe.distill.eagle3 import make_head

    head = make_head(tiny_model, feature_layers=(0, 1, 1), draft_token_ids=torch.arange(64),
                     warm_start=True, warm_attention=False, seed=0)
    seqs = [_prompted(40, 6, tiny_model.config.hidden_size, 5), _prompted(30, 4, tiny_model.config.hidden_size, 6)]
    for k in range(20, len(seqs[0])):
        seqs[0].token_ids[k] = seqs[0].token_ids[k - 14]
    seqs[0].top_ids[:, 0] = seqs[0].token_ids[1:].int()
    alone, looked = head_chain_hits_alone_and_with_lookup(head, seqs, lookup_below=1.0)
    assert torch.equal(alone.hits, head_chain_hits(head, seqs).hits)
    assert torch.equal(looked.hits, head_chain_hits(head, seqs, lookup_below=1.0).hits)
    assert not torch.equal(alone.hits, looked.hits)  # the repeated answer's copies changed some anchors


def test_training_defaults_follow_the_kind_and_an_explicit_value_wins():
    from specpipe.distill.config import DISTILL_KIND_DEFAULTS, DistillConfig

    assert DistillConfig(target="t", out="o", device="cpu").lr == DISTILL_KIND_DEFAULTS["model"]["lr"]
    head = DistillConfig(target="t", out="o", kind="eagle3", device="cpu")
    assert (head.lr, head.batch_tokens) == (DISTILL_KIND_DEFAULTS["eagle3"]["lr"], DISTILL_KIND_DEFAULTS["eagle3"]["batch_tokens"])
    assert DistillConfig(target="t", out="o", kind="eagle3", lr=1e-4, batch_tokens=None).lr == 1e-4
    assert head.prompt_weight == DISTILL_KIND_DEFAULTS["eagle3"]["prompt_weight"] == 1.0  # docs/eagle3.md 3m
    assert DistillConfig(target="t", out="o", device="cpu").prompt_weight == DISTILL_KIND_DEFAULTS["model"]["prompt_weight"]
    assert DistillConfig(target="t", out="o", kind="eagle3", prompt_weight=0.0).prompt_weight == 0.0
    # a time budget's split: heads give the answers less of it (docs/eagle3.md 3k, 3y); 0 is a value, not "unset"
    assert (head.data_fraction, DistillConfig(target="t", out="o").data_fraction) == (0.45, 0.6)
    assert DistillConfig(target="t", out="o", kind="eagle3", data_fraction=0.0).data_fraction == 0.0


def test_gpu_runs_default_to_gpu_sized_batches_and_an_explicit_value_wins(monkeypatch):
    """--device cuda (or auto where torch sees a GPU): the batch sizes the H200 run used; a CPU keeps the CPU ones."""
    from specpipe.distill import config
    from specpipe.distill.config import DISTILL_DEVICE_DEFAULTS, DISTILL_KIND_DEFAULTS, DistillConfig

    gpu, cpu = DISTILL_DEVICE_DEFAULTS["cuda"]["eagle3"], DISTILL_DEVICE_DEFAULTS["cpu"]["eagle3"]
    assert gpu["answer_batch"] > cpu["answer_batch"] and gpu["batch_tokens"] > DISTILL_KIND_DEFAULTS["eagle3"]["batch_tokens"]
    head = DistillConfig(target="t", out="o", kind="eagle3", device="cuda")
    assert (head.answer_batch, head.batch_tokens, head.lr) == (gpu["answer_batch"], gpu["batch_tokens"],
                                                              DISTILL_KIND_DEFAULTS["eagle3"]["lr"])
    mine = DistillConfig(target="t", out="o", kind="eagle3", device="cuda", answer_batch=8, batch_tokens=512)
    assert (mine.answer_batch, mine.batch_tokens) == (8, 512)
    draft = DistillConfig(target="t", out="o", device="cuda")  # the model kind keeps its own step size
    assert (draft.answer_batch, draft.batch_tokens) == (256, DISTILL_KIND_DEFAULTS["model"]["batch_tokens"])
    for visible, batch in ((True, gpu["answer_batch"]), (False, cpu["answer_batch"])):  # auto follows torch
        monkeypatch.setattr(config, "_cuda_visible", lambda: visible)
        assert DistillConfig(target="t", out="o", kind="eagle3").answer_batch == batch


def test_warm_start_passes_the_deepest_feature_through(tiny_model):
    """fc starts as identity on the last feature layer's block (plus the small random init), zero mean elsewhere."""
    from specpipe.distill.eagle3 import make_head

    width = tiny_model.config.hidden_size
    warm = make_head(tiny_model, feature_layers=(0, 1, 1), draft_token_ids=torch.arange(64),
                     warm_start=True, warm_attention=False, seed=0)
    cold = make_head(tiny_model, feature_layers=(0, 1, 1), draft_token_ids=torch.arange(64),
                     warm_start=False, warm_attention=False, seed=0)
    assert torch.allclose(warm.fc.weight[:, -width:] - torch.eye(width), cold.fc.weight[:, -width:], atol=1e-6)
    assert torch.equal(warm.fc.weight[:, :-width], cold.fc.weight[:, :-width])


def test_curve_command_trains_both_kinds_on_one_teacher_pass_and_plots(tiny_tokenizer, tmp_path, monkeypatch):
    import json

    from specpipe.distill.curve import main
    from specpipe.testing.tiny import make_tiny_llama

    tiny_target = make_tiny_llama(tmp_path / "eight", seed=2, num_layers=8, tokenizer=tiny_tokenizer)

    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path / "cache"))
    args = ["--target", str(tiny_target), "--answer-tokens", "400", "--train-tokens", "1200", "--points", "2",
            "--model-train-tokens", "12000",  # the model draft steps 4,096 tokens at a time
            "--first-tokens", "400", "--batch-tokens", "256", "--train-dtype", "float32", "--threads", "1",
            "--work", str(tmp_path / "work"), "--json", str(tmp_path / "curve.json"), "--plot", str(tmp_path / "c.png"),
            "--save-head", str(tmp_path / "head")]
    with pytest.raises(SystemExit) as done:
        main(args)
    assert done.value.code == 0
    result = json.loads((tmp_path / "curve.json").read_text())
    assert [r["kind"] for r in result["runs"]] == ["eagle3", "model"]
    for run in result["runs"]:
        assert len(run["points"]) == 2 and run["points"][-1]["tokens"] >= (1200 if run["kind"] == "eagle3" else 12000)
        assert len(run["points"][-1]["conditional"]) == 3
    assert (tmp_path / "c.png").stat().st_size > 0 and (tmp_path / "head" / "model.safetensors").is_file()
    assert len(list((tmp_path / "cache" / "distill-data").iterdir())) == 1  # one teacher pass served both kinds
    with pytest.raises(SystemExit) as refused:
        main(["--replot", str(tmp_path / "c.png")])  # not a curve's JSON: one line, exit 2
    assert refused.value.code == 2


def test_warm_attention_starts_the_head_as_the_targets_last_layer(tiny_model):
    """With the attention warm too, a head whose random parts are zeroed (fc's other blocks and its identity block's
    noise, the embedding half of q/k/v) is the target's last layer over the deepest feature: reading the residual
    stream entering that layer, its step-0 logits are the target's own over the draft vocabulary. A head that reads
    the wrong half of its input, or a wrong norm, or misses o_proj, does not reproduce them."""
    import copy

    from specpipe.distill.eagle3 import make_head

    tiny_model = copy.deepcopy(tiny_model)
    with torch.no_grad():  # norms unlike one another (a fresh model's are all ones), so a wrong one shows
        g = torch.Generator().manual_seed(11)
        for layer in tiny_model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(1.0 + 0.3 * torch.randn(norm.weight.shape, generator=g))
    width, layers = tiny_model.config.hidden_size, tiny_model.config.num_hidden_layers
    deepest = layers - 2  # layer-output id: the residual stream entering the last layer
    vocab_ids = torch.arange(0, 96)
    head = make_head(tiny_model, feature_layers=(0, deepest, deepest), draft_token_ids=vocab_ids, warm_start=True,
                     warm_attention=True, seed=0).eval()
    cold = make_head(tiny_model, feature_layers=(0, deepest, deepest), draft_token_ids=vocab_ids,
                     warm_start=True, warm_attention=False, seed=0)
    assert not torch.equal(head.midlayer.self_attn.q_proj.weight, cold.midlayer.self_attn.q_proj.weight)
    with pytest.raises(ValueError, match="needs warm_start"):  # its copies read the warm start's fc and norms
        make_head(tiny_model, feature_layers=(0, deepest, deepest), draft_token_ids=vocab_ids, warm_start=False,
                  warm_attention=True, seed=0)
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, -width:] = torch.eye(width)
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(head.midlayer.self_attn, name).weight[:, :width] = 0.0
        tokens = torch.randint(0, tiny_model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(7))
        out = tiny_model(tokens, output_hidden_states=True)
        features = torch.cat([out.hidden_states[1], out.hidden_states[deepest + 1], out.hidden_states[deepest + 1]], -1)
        # row i reads t_{i+1}: the last row's token is any (its embedding half weighs nothing here)
        head_tokens = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)
        state = head.unrolled(features, head_tokens, torch.ones(1, 12, dtype=torch.bool), steps=1)[0]
        assert torch.allclose(head.logits(state), out.logits[..., vocab_ids], atol=1e-4), \
            float((head.logits(state) - out.logits[..., vocab_ids]).abs().max())


def test_shape_buckets_change_neither_the_loss_nor_the_gradients(tiny_model, tmp_path, monkeypatch):
    """The head's batches and the loss's products are padded to bucketed shapes (oneDNN builds a kernel per shape);
    the padding must teach nothing: the same loss and gradients as unpadded shapes, over a partial candidate set."""
    import specpipe.distill.eagle3_train as eagle3_train
    import specpipe.distill.train as train

    hidden = tiny_model.config.hidden_size
    seqs = [_prompted(23, 7, hidden, 1), _prompted(37, 9, hidden, 2), _prompted(12, 5, hidden, 3)]
    trainer = _trainer(tiny_model, seqs, tmp_path, torch.arange(0, 64))
    trainer.negatives = 5  # a candidate set of the teacher's ids and 5 drawn ones, not the whole draft vocabulary
    assert eagle3_train.collate_head(seqs, 0, 2, prompt_weight=1.0)[0].shape[1] % eagle3_train.ROW_BUCKET == 0

    def loss_and_gradients():
        trainer.generator.manual_seed(7)
        trainer.student.zero_grad(set_to_none=True)
        loss, agreement, tokens = trainer._loss(seqs, "float32")
        loss.backward()
        return loss.detach(), agreement, tokens, {n: p.grad.clone() for n, p in trainer.student.named_parameters()
                                                   if p.grad is not None}

    bucketed = loss_and_gradients()
    monkeypatch.setattr(eagle3_train, "ROW_BUCKET", 1)
    monkeypatch.setattr(train, "SHAPE_BUCKET", 1)
    assert eagle3_train.collate_head(seqs, 0, 2, prompt_weight=1.0)[0].shape[1] == 36
    plain = loss_and_gradients()
    assert torch.allclose(bucketed[0], plain[0], rtol=1e-5, atol=1e-6), (float(bucketed[0]), float(plain[0]))
    assert bucketed[1:3] == plain[1:3]
    assert bucketed[3].keys() == plain[3].keys() and len(plain[3]) > 5
    for name, grad in plain[3].items():
        assert torch.allclose(bucketed[3][name], grad, rtol=1e-4, atol=1e-6), name


def test_candidate_logits_are_the_plain_product():
    from specpipe.distill.train import candidate_logits

    g = torch.Generator().manual_seed(0)
    hidden, head = torch.randn(70, 16, generator=g), torch.randn(300, 16, generator=g)
    candidates = torch.tensor([3, 9, 40, 41, 77, 200, 299])
    got = candidate_logits(hidden, head, candidates)
    assert got.shape == (70, 7)
    assert torch.allclose(got, hidden @ head[candidates].T, atol=1e-5)
