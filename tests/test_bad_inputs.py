"""Bad input from the command line: one `error:` line naming what is wrong, exit code 2, no traceback.

The nine cases of issue 29's sweep that were not clean (tracebacks, a silent hang, a folder named with shell
metacharacters, a truncated checkpoint reported as fine), each through the real CLI entry point.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import specpipe
from specpipe.checkpoint.load import safetensors_header
from specpipe.config import MAX_THREADS
from specpipe.errors import CheckpointError
from tests.test_cli_core import assert_one_line_error, run_cli

PROJECT_ROOT = Path(specpipe.__file__).resolve().parents[1]


def assert_usage_error(code, err, *needles):
    assert code == 2, err
    assert_one_line_error(code, err, *needles)


def test_build_engines_dir_that_is_a_file(capsys, tmp_path, tiny_target):
    (tmp_path / "a_file").write_text("not a folder")
    for engines_dir, needle in [(tmp_path / "a_file", "a_file is not a folder"),
                                (tmp_path / "a_file" / "below", "is a file")]:
        code, _, err = run_cli(capsys, "build", "--no-repo", "--target", str(tiny_target), "--draft", "ngram",
                               "--engines-dir", str(engines_dir))
        assert_usage_error(code, err, "--engines-dir", needle)
    assert (tmp_path / "a_file").read_text() == "not a folder"


def test_generate_prompt_with_non_utf8_bytes(capsys, tiny_build):
    # What Python makes of the argument bytes b"ab\xffc" (surrogateescape): the tokenizer raised a TypeError.
    code, out, err = run_cli(capsys, "generate", str(tiny_build), "-p", "ab\udcffc", "--max-tokens", "2")
    assert_usage_error(code, err, "the prompt is not valid UTF-8", "byte 0xff at character 2")
    assert out == ""


def test_generate_prompt_with_non_utf8_bytes_in_a_real_process(tiny_build):
    """The bytes themselves on a real command line, in-process and through --url (refused before connecting)."""
    for where in ([str(tiny_build)], ["--url", "127.0.0.1:1"]):
        proc = subprocess.run([sys.executable.encode(), b"-m", b"specpipe", b"generate", *map(os.fsencode, where),
                               b"-p", b"caf\xe9 \xff", b"--max-tokens", b"2"],
                              capture_output=True, cwd=PROJECT_ROOT, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "PYTHONWARNINGS": "ignore"})
        stderr = proc.stderr.decode(errors="replace")
        assert proc.returncode == 2, stderr
        assert_one_line_error(proc.returncode, stderr, "not valid UTF-8", "byte 0xe9 at character 3")


def test_generate_negative_seed(capsys, tiny_build):
    code, _, err = run_cli(capsys, "generate", str(tiny_build), "-p", "x", "--seed", "-1", "--temperature", "1")
    assert_usage_error(code, err, "--seed", "greater than or equal to 0")


def test_bench_prompt_file_that_is_not_utf8(capsys, tmp_path, tiny_build):
    prompts = tmp_path / "latin1.jsonl"
    prompts.write_bytes(json.dumps({"prompt": "x"}).encode() + b"\n" + '{"prompt": "café"}\n'.encode("latin-1"))
    code, _, err = run_cli(capsys, "bench", str(tiny_build), "--prompts", str(prompts), "--no-peer", "-k", "1",
                           "--max-new-tokens", "2")
    offset = len(json.dumps({"prompt": "x"})) + 1 + len('{"prompt": "caf')
    assert_usage_error(code, err, f"--prompts {prompts}", f"not UTF-8 text (byte 0xe9 at offset {offset})")


@pytest.mark.parametrize("threads", ["100000", str(MAX_THREADS + 1), "0", "-1"])
def test_generate_threads_out_of_range_is_refused_before_loading(capsys, tmp_path, threads):
    """Refused from the value alone: ENGINE_DIR does not even exist (100000 threads hung ONNX Runtime)."""
    code, _, err = run_cli(capsys, "generate", str(tmp_path / "no_engines"), "-p", "x", "--threads", threads)
    expected = f"more than {MAX_THREADS}" if int(threads) > MAX_THREADS else "greater than or equal to 1"
    assert_usage_error(code, err, "--threads", expected)


@pytest.mark.parametrize("command", ["build", "bench", "validate"])
@pytest.mark.parametrize("threads", ["0", "-1", "100000"])
def test_threads_are_refused_alike_by_every_command(capsys, tmp_path, tiny_target, command, threads):
    args = {"build": ["build", "--no-repo", "--target", str(tiny_target), "--draft", "ngram",
                      "--engines-dir", str(tmp_path / "e")],
            "bench": ["bench", str(tmp_path / "no_engines")],
            "validate": ["validate", str(tmp_path / "no_engines"), "--in-process"]}[command]
    code, _, err = run_cli(capsys, *args, "--threads", threads)
    assert_usage_error(code, err, "--threads")
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("name", ["x;rm -rf *?<>|", "a b", "$(reboot)", "-rf", ".hidden", "..", "a/b", "x" * 129])
def test_build_name_takes_a_safe_charset_only(capsys, tmp_path, tiny_target, name):
    code, _, err = run_cli(capsys, "build", "--no-repo", "--target", str(tiny_target), "--draft", "ngram",
                           "--engines-dir", str(tmp_path / "e"), "--name", name)
    assert_usage_error(code, err, "--name", "not a plain folder name", "letters, digits and . _ + -")
    assert not (tmp_path / "e").exists()


def _copy(checkpoint: Path, to: Path) -> Path:
    shutil.copytree(checkpoint, to)
    return to


def test_inspect_says_a_truncated_checkpoint_is_broken(capsys, tmp_path, tiny_target):
    broken = _copy(tiny_target, tmp_path / "truncated")
    weights = broken / "model.safetensors"
    whole = weights.stat().st_size
    os.truncate(weights, whole // 5)
    code, out, err = run_cli(capsys, "inspect", str(broken))
    assert_usage_error(code, err, "model.safetensors is truncated", f"{whole // 5:,} of the {whole:,} bytes")
    assert out == ""
    # build resolves the same way: the broken target is refused before anything is exported
    code, _, err = run_cli(capsys, "build", "--no-repo", "--target", str(broken), "--draft", "ngram",
                           "--engines-dir", str(tmp_path / "e"))
    assert_usage_error(code, err, "is truncated")
    assert not (tmp_path / "e").exists()


def test_inspect_of_a_whole_checkpoint_still_works(capsys, tiny_target):
    code, out, err = run_cli(capsys, "inspect", str(tiny_target), "--json")
    assert code == 0, err
    assert json.loads(out)["checkpoint"]["num_parameters"] > 0


def _header_bytes(header: dict) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw


@pytest.mark.parametrize("case, needle", [
    ("appended", "is broken"),
    ("header_cut", "too short for its own header"),
    ("empty", "too short for its own header"),
    ("not_json", "not JSON with data_offsets"),
])
def test_safetensors_whose_size_disagrees_with_its_header_are_broken(tmp_path, case, needle):
    header = {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "__metadata__": {"format": "pt"}}
    whole = _header_bytes(header) + bytes(16)
    file = tmp_path / "model.safetensors"
    file.write_bytes({"appended": whole + b"\0", "header_cut": whole[:20], "empty": b"",
                      "not_json": struct.pack("<Q", 5) + b"nope!" + bytes(16)}[case])
    with pytest.raises(CheckpointError, match=needle):
        safetensors_header(file)
    file.write_bytes(whole)
    assert safetensors_header(file)["w"]["shape"] == [4]


def test_a_missing_shard_is_named(capsys, tmp_path, tiny_target):
    sharded = _copy(tiny_target, tmp_path / "sharded")
    header = safetensors_header(sharded / "model.safetensors")
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    weight_map = {name: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, name in enumerate(header)
                  if name != "__metadata__"}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    code, _, err = run_cli(capsys, "inspect", str(sharded))
    assert_usage_error(code, err, "missing 1 of the 2 weight shards", "model-00002-of-00002.safetensors")
