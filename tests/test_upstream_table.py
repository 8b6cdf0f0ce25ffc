"""What a dry run writes for TensorRT-LLM, checked against the one table of upstream names (upstream.FACTS).

llama-70b + llama-7b with --backend trtllm: model.yaml (LLM-API flow, TensorRT-LLM v1.3.0rc26) and the trtllm-build
commands and config.pbtxt parameters (engine flow, 1.2.1). A key or flag that changes in the code and not in the
table (or the reverse) fails here. Then an EAGLE-3 head made in upstream's format plans with its captured layers.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from specpipe.builder import make_plan, write_plan_repository
from specpipe.builder.config import BuildConfig
from specpipe.config import make_config
from specpipe.engines import upstream
from specpipe.errors import UsageError
from specpipe.triton.model_config import parse_config


def _cfg(tmp_path: Path, **backend) -> BuildConfig:
    draft = backend.pop("draft", "llama-7b")
    return make_config(
        BuildConfig, target="llama-70b", draft=draft, engines_dir=tmp_path / "engines", repo_dir=tmp_path / "repo",
        backend={"kind": "trtllm", "dry_run": True, "tp_size": 8, **backend},
    )  # fmt: skip


def _written_yaml(tmp_path: Path, **backend) -> dict:
    cfg = _cfg(tmp_path, **backend)
    write_plan_repository(make_plan(cfg), cfg)
    return yaml.safe_load((tmp_path / "repo" / "tensorrt_llm" / "1" / "model.yaml").read_text())


def yaml_problems(model_yaml: dict) -> list[str]:
    """Every model.yaml key, speculative_config key and decoding_type against the table."""
    problems = [f"model.yaml key {k!r} is not in upstream.FACTS" for k in model_yaml if k not in upstream.facts("model.yaml")]
    spec = model_yaml["speculative_config"]
    problems += [f"speculative_config key {k!r} is not in upstream.FACTS" for k in spec if k not in upstream.facts("speculative_config")]
    if spec["decoding_type"] not in upstream.facts("decoding_type").values():
        problems.append(f"decoding_type {spec['decoding_type']!r} is not in upstream.FACTS")
    kv = upstream.facts("kv_cache_config")
    problems += [f"kv_cache_config key {k!r} is not in upstream.FACTS" for k in model_yaml["kv_cache_config"] if k not in kv]
    return problems


def flag_problems(argv: tuple[str, ...]) -> list[str]:
    table = upstream.facts("trtllm-build")
    problems = []
    for i, item in enumerate(argv):
        if not item.startswith("--"):
            continue
        if item not in table:
            problems.append(f"trtllm-build flag {item} is not in upstream.FACTS")
        elif table[item] is not None and argv[i + 1] != table[item]:
            problems.append(f"trtllm-build {item} {argv[i + 1]} is not the table's {table[item]}")
    return problems


def test_the_70b_7b_model_yaml_matches_the_table(tmp_path):
    model_yaml = _written_yaml(tmp_path)
    assert yaml_problems(model_yaml) == []
    assert model_yaml["speculative_config"]["decoding_type"] == upstream.facts("decoding_type")["draft_target"] == "Draft_Target"


def test_a_changed_key_fails_the_check(tmp_path):
    model_yaml = _written_yaml(tmp_path)
    renamed = {**model_yaml, "speculative_config": {**model_yaml["speculative_config"], "decoding_type": "DraftTarget"}}
    assert yaml_problems(renamed) == ["decoding_type 'DraftTarget' is not in upstream.FACTS"]
    old_gate = {**model_yaml, "speculative_config": {**model_yaml["speculative_config"], "acceptance_window": 8}}
    assert yaml_problems(old_gate) == ["speculative_config key 'acceptance_window' is not in upstream.FACTS"]
    assert flag_problems(("trtllm-build", "--use_paged_context_fmha", "disable")) == [
        "trtllm-build --use_paged_context_fmha disable is not the table's enable"
    ]


def test_the_70b_7b_engine_flow_matches_the_table(tmp_path):
    cfg = _cfg(tmp_path, trtllm_flow="engine")
    plan = make_plan(cfg)
    builds = [s.argv for s in plan.steps if s.argv and s.argv[0] == upstream.TRTLLM_BUILD]
    assert len(builds) == 2 and [flag_problems(argv) for argv in builds] == [[], []]
    write_plan_repository(plan, cfg)
    config = parse_config((tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt").read_text())
    table = upstream.facts("config.pbtxt:tensorrt_llm")
    assert set(table) <= set(config.parameters)
    assert all(config.parameters[k].string_value == v for k, v in table.items() if v is not None)


def test_every_fact_names_its_source():
    assert all(f.path and f.commit for f in upstream.FACTS)
    assert upstream.TRTLLM_LLMAPI_TAG == "v1.3.0rc26" and upstream.TRTLLM_LLMAPI_COMMIT == "c295dd9fca"


# ---- EAGLE-3 heads --------------------------------------------------------------------------------------------


def _head(folder: Path, architecture: str = "LlamaForCausalLMEagle3", layers=(2, 39, 76)) -> Path:
    """A tiny head in EAGLE's format: config.json (70B's width, one layer) and the documented tensor names."""
    from safetensors.numpy import save_file

    folder.mkdir()
    config = {
        "architectures": [architecture], "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
        "num_key_value_heads": 8, "num_hidden_layers": 1, "vocab_size": 128256, "draft_vocab_size": 32000,
        "max_position_embeddings": 8192, "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layers)},
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    save_file({name: np.zeros((2, 2), dtype=np.float16) for name in upstream.EAGLE3_TENSORS}, str(folder / "model.safetensors"))
    return folder


def test_an_eagle3_head_plans_with_its_captured_layers(tmp_path):
    head = _head(tmp_path / "head")
    assert not (head / "tokenizer.json").exists()  # resolution needs none
    cfg = _cfg(tmp_path, draft=str(head), max_batch_size=16)
    plan = make_plan(cfg)
    assert any("eagle3_layers_to_capture [2, 39, 76]" in n for n in plan.notes)
    write_plan_repository(plan, cfg)
    model_yaml = yaml.safe_load((tmp_path / "repo" / "tensorrt_llm" / "1" / "model.yaml").read_text())
    spec = model_yaml["speculative_config"]
    assert spec["decoding_type"] == "Eagle3" and spec["eagle3_layers_to_capture"] == [2, 39, 76]
    # plan {1: 8, 4: 4, 8: 2, 16: 1}: batch 1-3 draft 8, 4-7 draft 4, 8-15 draft 2, 16 drafts 1
    assert spec["draft_len_schedule"] == {1: 8, 3: 8, 7: 4, 15: 2, 16: 1}
    assert yaml_problems(model_yaml) == []


def test_a_speculators_head_is_refused_in_one_line(tmp_path):
    head = _head(tmp_path / "spec-head", architecture="Eagle3Speculator")
    with pytest.raises(UsageError, match="speculators' format") as err:
        make_plan(_cfg(tmp_path, draft=str(head)))
    assert "\n" not in str(err.value)


def test_upstream_schedule_gives_the_planned_draft_length_at_every_batch():
    """Read the emitted schedule as utils.py get_draft_len_for_batch_size does (first key >= batch, else 0)."""
    from bisect import bisect_left

    from specpipe.builder.trtllm import default_draft_len_schedule, upstream_draft_len_schedule

    for k, max_batch in ((8, 8), (4, 64), (8, 256), (5, 2)):
        plan = default_draft_len_schedule(k, max_batch)
        emitted = upstream_draft_len_schedule(plan, max_batch)
        keys = list(emitted)
        for batch in range(1, max_batch + 1):
            idx = bisect_left(keys, batch)
            got = emitted[keys[idx]] if idx < len(keys) else 0
            wanted = plan[max(b for b in plan if b <= batch)]
            assert got == wanted, (k, max_batch, batch)
        assert emitted[1] == k
