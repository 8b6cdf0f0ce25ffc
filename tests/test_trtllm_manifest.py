"""A TensorRT-LLM build writes the same typed manifest as a CPU build: the dry run shows it, the real build's last
step writes it (here run on tiny checkpoints: only the manifest step, which needs no GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specpipe.builder import make_plan
from specpipe.builder.run import _manifest
from specpipe.builder.trtllm_manifest import AT_BUILD
from specpipe.contract.manifest import MANIFEST
from specpipe.drafts import manifest_of, read_manifest
from specpipe.drafts.model import ModelDraft
from specpipe.drafts.ngram import NgramDraft
from specpipe.errors import EngineError
from tests.test_gpu_plan import _cfg, _engine_cfg

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def test_llmapi_dry_run_plan_holds_the_manifest_the_build_writes(tmp_path):
    plan = make_plan(_cfg(tmp_path))
    manifest = plan.manifest
    assert manifest is not None
    assert manifest_of(json.loads(manifest.model_dump_json())) == manifest  # reads back as written
    assert (manifest.target.engine.backend, manifest.target.engine.graph, manifest.target.engine.path) == ("trtllm", "hf", "hf/target")
    assert isinstance(manifest.draft, ModelDraft) and manifest.draft.engine.path == "hf/draft"
    assert manifest.tokenizer.hash == AT_BUILD and manifest.max_draft_len == 8
    # Draft_Target: K up to max_concurrency (none here: the default plan never drafts 0 up to batch 8)
    assert manifest.serving.max_batch_size == 8 and manifest.serving.draft_schedule == {8: 8}
    assert manifest.build["backend"]["kind"] == "trtllm"
    (step,) = [s for s in plan.steps if s.id == "manifest"]
    assert step.writes == (str(Path(plan.work_dir) / MANIFEST),)
    assert [s.id for s in plan.steps][-2:] == ["manifest", "plan"]  # written after every GPU step


def test_engine_flow_and_ngram_and_schedules(tmp_path):
    engine = make_plan(_engine_cfg(tmp_path)).manifest
    assert engine.target.engine.graph == "trtllm-engine" and engine.target.engine.path == "trtllm/target/engine"
    assert engine.serving.draft_schedule is None  # 1.2.1: clients choose num_draft_tokens per request
    ngram = make_plan(_cfg(tmp_path, draft="ngram", draft_len_schedule={1: 8, 4: 0})).manifest
    assert isinstance(ngram.draft, NgramDraft)
    assert ngram.serving.draft_schedule == {3: 8}  # max_concurrency 3: speculation off from batch 4 on


def test_dry_run_shows_the_manifest_and_writes_none(tmp_path):
    cmd = [sys.executable, "-m", "specpipe", "build", "--target", "llama-70b", "--draft", "llama-7b", "--backend", "trtllm",
           "--dry-run"]
    text = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env={"PYTHONPATH": str(PROJECT_ROOT), "HF_HUB_OFFLINE": "1"})
    assert text.returncode == 0, text.stderr
    assert "Manifest (manifest.json, written last" in text.stdout and "trtllm hf hf/target" in text.stdout
    as_json = subprocess.run(cmd + ["--json"], cwd=tmp_path, capture_output=True, text=True,
                             env={"PYTHONPATH": str(PROJECT_ROOT), "HF_HUB_OFFLINE": "1"})
    assert json.loads(as_json.stdout)["manifest"]["target"]["engine"]["backend"] == "trtllm"
    assert not list(tmp_path.glob(f"engines/*/{MANIFEST}"))  # a dry run is not a build


def test_the_build_step_writes_a_manifest_that_reads_back_and_refuses_to_load_here(tmp_path, tiny_target, tiny_draft):
    from specpipe.checkpoint import load_tokenizer

    cfg = _cfg(tmp_path, target=str(tiny_target), draft=str(tiny_draft), max_input_len=64, max_seq_len=128)
    plan = make_plan(cfg)
    work = Path(plan.work_dir)
    for role, folder in (("target", tiny_target), ("draft", tiny_draft)):  # what the resolve steps leave
        (work / "hf").mkdir(parents=True, exist_ok=True)
        (work / "hf" / role).symlink_to(Path(folder).absolute(), target_is_directory=True)
    load_tokenizer(tiny_target).save_pretrained(str(work / "tokenizer"))
    _manifest(None, plan, cfg, work)
    manifest = read_manifest(work)
    assert manifest.tokenizer.hash != AT_BUILD and manifest.eos_token_ids
    assert manifest.target.weights_sha256 and manifest.target.engine.files  # the loaded folder, hashed
    assert manifest.target.checkpoint["shape"]["layers"] == 2
    from specpipe.deployment import load_deployment

    with pytest.raises(EngineError, match="TensorRT-LLM build.*validate --endpoint"):
        load_deployment(work)
