"""`specpipe build` / `generate` from the command line: outputs, and one-line errors on bad input."""

import json
import os
import subprocess
import sys

import pytest

from specpipe.cli import main


def run_cli(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
        raise SystemExit(0)
    out, err = capsys.readouterr()
    return exc.value.code or 0, out, err


def assert_one_line_error(code, err, *needles):
    assert code != 0
    lines = [line for line in err.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    # progress lines may precede it; the reason is one line, the last, and there is no traceback
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in err, err
    for needle in needles:
        assert needle in errors[0], errors[0]


def test_generate_json_has_the_fields(capsys, tiny_build):
    code, out, _ = run_cli(capsys, "generate", str(tiny_build), "--prompt", "def add(a, b):", "--max-tokens", "8", "--json")
    assert code == 0
    result = json.loads(out)
    for key in ["text", "token_ids", "num_generated", "drafted", "accepted", "acceptance_rate", "mean_accepted_len",
                "ttft_ms", "tokens_per_s"]:
        assert key in result
    assert result["num_generated"] == len(result["token_ids"]) <= 8


def test_generate_chat_and_no_speculative(capsys, tiny_build):
    code, out, _ = run_cli(capsys, "generate", str(tiny_build), "-p", "hi", "--chat", "--no-speculative", "--max-tokens", "4",
                           "--json")
    assert code == 0 and json.loads(out)["drafted"] == 0


def test_manifest_records_the_build(tiny_build):
    manifest = json.loads((tiny_build / "manifest.json").read_text())
    assert manifest["target"]["export_check"]["max_abs_diff"] < manifest["target"]["export_check"]["tolerance"]
    assert manifest["draft"]["kind"] == "model"
    assert manifest["tokenizer"]["hash"] and manifest["versions"]["onnxruntime"]
    assert "model.onnx" in manifest["target"]["engine"]["files"]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["-k", "0"], "--num-draft-tokens"),
        (["--max-tokens", "0"], "--max-new-tokens"),
        (["--temperature", "-1"], "--temperature"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["-k", "99"], "max_draft_len"),
    ],
)
def test_generate_bad_values(capsys, tiny_build, args, needle):
    code, _, err = run_cli(capsys, "generate", str(tiny_build), "-p", "x", *args)
    assert_one_line_error(code, err, needle)


def test_generate_max_tokens_beyond_the_context_is_an_error(capsys, tiny_build):
    code, out, err = run_cli(capsys, "generate", str(tiny_build), "-p", "def add(a, b):", "--max-tokens", "100000")
    assert code == 2 and out == ""
    assert_one_line_error(code, err, "exceeds the engine's max_seq_len 1024", "new tokens fit after this prompt")


def test_generate_missing_engine_folder(capsys, tmp_path):
    code, _, err = run_cli(capsys, "generate", str(tmp_path / "nope"), "-p", "x")
    assert_one_line_error(code, err, "nope")


def test_build_missing_path_leaves_nothing(capsys, tmp_path, tiny_target):
    code, _, err = run_cli(capsys, "build", "--no-repo", "--target", str(tiny_target), "--draft", str(tmp_path / "missing"),
                           "--engines-dir", str(tmp_path / "e"), "--name", "x")
    assert_one_line_error(code, err, "missing")
    assert not (tmp_path / "e" / "x").exists()


def test_build_not_a_checkpoint(capsys, tmp_path, tiny_target):
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli(capsys, "build", "--no-repo", "--target", str(tmp_path / "empty"), "--draft", str(tiny_target),
                           "--engines-dir", str(tmp_path / "e"))
    assert_one_line_error(code, err, "config.json")


def test_build_incompatible_pair_leaves_nothing(capsys, tmp_path, tiny_target, tiny_other_vocab):
    code, _, err = run_cli(capsys, "build", "--no-repo", "--target", str(tiny_target), "--draft", str(tiny_other_vocab),
                           "--engines-dir", str(tmp_path / "e"), "--name", "bad")
    assert_one_line_error(code, err, "incompatible")
    assert not (tmp_path / "e" / "bad").exists()
    assert not list((tmp_path / "e").glob(".bad*")) if (tmp_path / "e").exists() else True


def test_build_bad_max_draft_len(capsys, tmp_path, tiny_target):
    code, _, err = run_cli(capsys, "build", "--no-repo", "--target", str(tiny_target), "--draft", str(tiny_target), "--max-draft-len", "0",
                           "--engines-dir", str(tmp_path))
    assert_one_line_error(code, err, "--max-draft-len")


def test_build_existing_output_needs_force(capsys, tiny_build):
    code, _, err = run_cli(capsys, "build", "--no-repo", "--target", "x", "--draft", "y", "--engines-dir", str(tiny_build.parent),
                           "--name", tiny_build.name)
    assert_one_line_error(code, err, "--force")
    assert (tiny_build / "manifest.json").is_file()


def test_real_process_prints_no_traceback(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "specpipe", "generate", str(tmp_path / "none"), "-p", "x"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.strip().startswith("error:")
