"""The LLM-API flow for real: TensorRT-LLM (>= 1.3, PyTorch backend) takes the arguments specpipe writes.

gpu-marked: skipped where CUDA is not available (tests/conftest.py), and each test also needs the
tensorrt_llm package. Nothing here has run in the session that wrote it (no GPU, and TensorRT-LLM's PyPI
package is a stub there); the plans are tested without a GPU in tests/test_gpu_plan.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.gpu

MAX_DRAFT_LEN = 4
PROMPTS = ["def add(a, b):", "The capital of France is", "1, 2, 3, 4,"]


def _tensorrt_llm():
    return pytest.importorskip("tensorrt_llm", reason="needs the tensorrt_llm package (>= 1.3)")


@pytest.fixture(scope="module")
def written(tiny_target, tiny_draft, tmp_path_factory) -> dict:
    """The plan's files for the tiny pair, with the resolve step's links made by hand (no hub)."""
    from specpipe.builder import make_plan, write_plan_repository
    from specpipe.builder.config import BuildConfig, TrtllmBackend
    from specpipe.builder.plan import SERVE_CONFIG

    _tensorrt_llm()
    root = tmp_path_factory.mktemp("llmapi")
    cfg = BuildConfig(
        target=str(tiny_target), draft=str(tiny_draft), engines_dir=root / "engines", repo_dir=root / "repo",
        max_draft_len=MAX_DRAFT_LEN, backend=TrtllmBackend(max_batch_size=8, max_input_len=64, max_seq_len=256, dry_run=True),
    )  # fmt: skip
    plan = make_plan(cfg)
    work = Path(plan.work_dir)
    for role, folder in (("target", tiny_target), ("draft", tiny_draft)):
        link = work / "hf" / role
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path(folder).absolute(), target_is_directory=True)
    write_plan_repository(plan, cfg)
    return {
        "plan": plan,
        "serve": yaml.safe_load((work / SERVE_CONFIG).read_text()),
        "model_yaml": yaml.safe_load((root / "repo" / "tensorrt_llm" / "1" / "model.yaml").read_text()),
    }


def _generate(llm_args: dict, prompts: list[str]) -> list[list[int]]:
    from tensorrt_llm import LLM, SamplingParams

    llm = LLM(**llm_args)
    try:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
        return [list(out.outputs[0].token_ids) for out in outputs]
    finally:
        llm.shutdown()


def test_tensorrt_llm_validates_the_yaml_specpipe_writes(written):
    """TorchLlmArgs (the LLM API's own pydantic model) accepts every key; the two-model Draft_Target path takes no
    draft_len_schedule at v1.3.0rc26 (support_dynamic_draft_len), and the plan {1: 4, 4: 2, 8: 1} never reaches 0."""
    from tensorrt_llm.llmapi.llm_args import TorchLlmArgs

    args = TorchLlmArgs(model=written["model_yaml"]["model"], **written["serve"])
    assert args.speculative_config.max_draft_len == MAX_DRAFT_LEN
    assert args.speculative_config.draft_len_schedule is None and args.speculative_config.max_concurrency is None
    assert args.max_batch_size == 8


def test_model_yaml_minus_triton_config_is_what_the_llmapi_model_passes_to_llm(written):
    """llmapi model.py: update_llm_args_with_extra_dict({}, model.yaml minus triton_config) -> LLM(**args)."""
    from tensorrt_llm.llmapi.llm_utils import update_llm_args_with_extra_dict

    engine_args = update_llm_args_with_extra_dict({}, {k: v for k, v in written["model_yaml"].items() if k != "triton_config"})
    assert engine_args["speculative_config"].decoding_type == "Draft_Target"


def test_greedy_speculative_output_equals_target_only(written):
    """Draft-target speculation never changes greedy output, at batch sizes on both sides of the schedule's steps."""
    args = {k: v for k, v in written["model_yaml"].items() if k != "triton_config"}
    target_only = {k: v for k, v in args.items() if k not in ("speculative_config", "disable_overlap_scheduler")}
    for prompts in (PROMPTS[:1], PROMPTS * 3):  # batch 1 (K = 4) and batch 9 (past the schedule's last step)
        assert _generate(args, prompts) == _generate(target_only, prompts)
