"""Draft kinds as a registry (specpipe/drafts/) and K in one place (contract/decoding.py).

The toy kind below lives only in this file: registered here, it is built by `specpipe build --draft repeat:3`,
written to and read back from the manifest, opened by the deployment and decoded through its generator. That it
works with no other file edited is what "adding a kind is one new file and one registry line" means.
"""

from __future__ import annotations

import json
from typing import ClassVar, Literal, Optional

import pytest

from specpipe.cli import main
from specpipe.contract.decoding import DecodingPolicy
from specpipe.contract.generation import GenerationConfig
from specpipe.contract.manifest import DraftEntry
from specpipe.deployment import load_deployment
from specpipe.drafts import KINDS, DraftKind, kind_of, manifest_of, read_manifest, register
from specpipe.errors import EngineError, UsageError
from specpipe.speculative.drafters import Drafter, DraftSession, Proposal
from specpipe.testing.greedy import assert_greedy_equivalent
from tests.test_self_draft import build_args


# ---- the toy kind: `--draft repeat:N` proposes the context's last token, at most N times ----------------------

class RepeatSession(DraftSession):
    def __init__(self, copies: int):
        self.copies = copies

    def propose(self, context, k, sampling, rng):
        return Proposal([context[-1]] * min(k, self.copies), None)  # point masses: exact under sampling too


class RepeatDrafter(Drafter):
    name = "repeat"

    def __init__(self, copies: int):
        self.copies = copies

    def new_request(self, cfg: Optional[GenerationConfig] = None) -> DraftSession:
        return RepeatSession(self.copies)


class RepeatDecoding(DecodingPolicy):
    backends = ("onnxruntime",)


class RepeatDraft(DraftEntry):
    kind: Literal["repeat"] = "repeat"
    copies: int
    policy: ClassVar = RepeatDecoding


class RepeatKind(DraftKind):
    name = "repeat"
    entry = RepeatDraft

    @classmethod
    def claims(cls, spec):
        return spec.startswith("repeat:")

    @classmethod
    def drafter(cls, folder, entry, target, threads):
        return RepeatDrafter(entry.copies)

    @classmethod
    def build(cls, spec, out, ctx):
        ctx.say(f"the repeat draft ({spec}) has no files")
        return RepeatDraft(source=spec, copies=int(spec.removeprefix("repeat:")))


@pytest.fixture(scope="module")
def repeat_kind():
    register(RepeatKind)
    yield RepeatKind
    del KINDS["repeat"]


@pytest.fixture(scope="module")
def repeat_build(tmp_path_factory, tiny_target, repeat_kind):
    engines = tmp_path_factory.mktemp("repeat-engines")
    with pytest.raises(SystemExit) as exc:
        main(build_args(tiny_target, engines, "repeat", "--draft", "repeat:3", "--max-batch-size", "1"))
        raise SystemExit(0)
    assert not exc.value.code
    return engines / "repeat"


def test_a_kind_registered_in_a_test_is_built_served_and_decoded(repeat_build):
    written = json.loads((repeat_build / "manifest.json").read_text())
    assert written["draft"] == {"kind": "repeat", "source": "repeat:3", "copies": 3}
    manifest = read_manifest(repeat_build)
    assert isinstance(manifest.draft, RepeatDraft) and manifest.as_dict() == written  # reads back as written
    assert isinstance(manifest.decoding, RepeatDecoding) and manifest.decoding.max_draft_len == 8
    deployment = load_deployment(repeat_build, threads=1)
    assert isinstance(deployment.drafter, RepeatDrafter) and deployment.drafter.copies == 3
    prompt = "The quick brown fox. The quick brown"
    alone = deployment.generator.generate(prompt, deployment.generation_config(max_new_tokens=30, speculative=False,
                                                                               stop_on_eos=False))
    spec = deployment.generator.generate(prompt, deployment.decoding.request(5, max_new_tokens=30, stop_on_eos=False))
    assert spec.stats.drafted > 0 and len(spec.stats.drafted_at) == 3  # K = 5 asked, 3 copies proposed
    assert_greedy_equivalent(deployment, prompt, spec.token_ids, alone.token_ids)


def test_the_registry_picks_a_kind_by_its_draft_value(repeat_kind):
    assert [kind_of(spec).name for spec in ("none", "ngram", "self:int4-wo", "repeat:2", "some/checkpoint")] == [
        "none", "ngram", "self", "repeat", "model"]
    assert list(KINDS)[-1] == "model"  # the catch-all stays last, so a registered kind is asked before it
    with pytest.raises(ValueError):
        register(RepeatKind)


def test_an_unknown_kind_is_refused_in_one_line(tiny_build):
    data = read_manifest(tiny_build).as_dict()
    data["draft"] = {"kind": "medusa", "source": "x"}
    with pytest.raises(Exception, match="draft kind 'medusa' is none this specpipe knows"):
        manifest_of(data)


# ---- K in one place -----------------------------------------------------------------------------------------

def test_the_as_deployed_zero_k_rule():
    policy = DecodingPolicy(max_draft_len=6)
    deployed = policy.request(None, max_new_tokens=9)
    assert (deployed.speculative, deployed.draft_length, deployed.max_draft_tokens) == (True, "adaptive", 6)
    assert deployed.max_new_tokens == 9
    alone = policy.request(0, num_draft_tokens=3)
    assert alone.speculative is False
    fixed = policy.request(5, speculative=False)  # the requested K wins over the fields it is given
    assert (fixed.speculative, fixed.draft_length, fixed.num_draft_tokens) == (True, "fixed", 5)
    with pytest.raises(EngineError, match="num_draft_tokens 7 > max_draft_len 6"):
        policy.request(7)
    with pytest.raises(UsageError, match="must be >= 0"):
        policy.request(-1)
    assert DecodingPolicy.requested(None) == {} and DecodingPolicy.requested(0) == {"speculative": False}
    assert policy.adaptive_ceiling == 6 and DecodingPolicy(max_draft_len=32).adaptive_ceiling == 16


def test_one_schedule_format_read_from_text_or_mapping_and_written_as_text():
    from_text = DecodingPolicy(draft_len_schedule="1:4,4:2,8:0")
    assert from_text.draft_len_schedule == {1: 4, 4: 2, 8: 0}
    assert from_text.schedule_rows() == [(1, 4), (4, 2), (8, 0)]
    assert DecodingPolicy(draft_len_schedule={"1": 4, "4": 2, "8": 0}) == from_text  # JSON's string keys
    assert from_text.model_dump(mode="json")["draft_len_schedule"] == "1:4,4:2,8:0"
    for bad in ("4", "2:1,1:3", "a:1", "0:2"):
        with pytest.raises(ValueError):
            DecodingPolicy(draft_len_schedule=bad)


def test_an_existing_manifest_reads_as_before_with_its_schedule(tiny_build):
    """Manifests written before the schedule was typed: `serving.draft_schedule` as text, a first build's draft
    without a kind. Both read, and write back the same JSON."""
    data = read_manifest(tiny_build).as_dict()
    data["serving"]["draft_schedule"] = "1:3,8:0"
    manifest = manifest_of(json.loads(json.dumps(data)))
    assert manifest.as_dict() == data
    assert manifest.decoding.schedule_rows() == [(1, 3), (8, 0)]
    del data["draft"]["kind"]
    assert manifest_of(data).draft.kind == "model"


def test_a_kind_is_refused_on_a_backend_its_policy_does_not_support(repeat_kind, tiny_target, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(RepeatDecoding, "backends", ("trtllm",))
    with pytest.raises(SystemExit) as exc:
        main(build_args(tiny_target, tmp_path, "repeat", "--draft", "repeat:3"))
    assert exc.value.code == 2
    assert "--draft repeat:3 (a repeat draft) runs on trtllm, not --backend onnxruntime" in capsys.readouterr().err
    assert not (tmp_path / "repeat").exists()
