"""Run onnxruntime-genai's model builder on a Hugging Face checkpoint, under specpipe's transformers 4.57.

The builder (`python -m onnxruntime_genai.models.builder`, onnxruntime-genai 0.18) writes a decoder
graph with GroupQueryAttention over a shared past/present KV buffer and, for int4, MatMulNBits from
the fp32 weights, plus the `genai_config.json` its runtime reads. Two things stop it on the
transformers that specpipe pins (4.57.x: optimum-onnx 0.1.0 needs < 4.58, and transformers 5 cannot
save GGUF-loaded checkpoints):

- its builder modules import model classes that exist only in transformers 5 (`_TRANSFORMERS_5_NAMES`);
  none of them is used for a Llama-family model, so a placeholder class under each name lets the
  imports pass;
- it reads RoPE settings the transformers-5 way, from `config.rope_scaling` with a `rope_type` and a
  `rope_theta`; a 4.57 checkpoint keeps `rope_theta` at the top level and `rope_scaling` null. The
  builder gets a view of the checkpoint (symlinks) whose config.json carries both.

Checked with transformers 4.57.6, onnxruntime-genai 0.18.0 and onnxruntime 1.32.0 (SmolLM2-135M:
fp32 in ~8 s on 2 cores).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Literal, Optional, Sequence

from specpipe.errors import ExportError, last_line

Precision = Literal["fp32", "int8", "int4"]

# Imported by onnxruntime_genai.models.builders.* at module level; only in transformers >= 5.
_TRANSFORMERS_5_NAMES = (
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Lfm2VlForConditionalGeneration",
    "Gemma3ForConditionalGeneration",
    "Mistral3ForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
)
BUILDER_MODULE = "onnxruntime_genai.models.builder"
CANCEL_POLL_S = 0.5  # how often a running builder looks at its cancel event


def run_model_builder(checkpoint_dir: Path, out_dir: Path, precision: Precision, cache_dir: Path, *,
                      extra_options: Optional[dict[str, str]] = None, feature_layers: Optional[Sequence[int]] = None,
                      logits_index: bool = True, timeout_s: float = 1800,
                      cancel: Optional[threading.Event] = None) -> Path:
    """Build `checkpoint_dir` into `out_dir` (model.onnx, model.onnx.data, genai_config.json, tokenizer files)
    for the CPU execution provider at `precision`. Raises ExportError in one line on any failure.

    `feature_layers` (layer-output ids, export/features.py; None: off) adds the output `aux_hidden_states`
    [batch, new tokens, hidden * len(feature_layers)]: the residual stream after each of those layers, for an
    EAGLE-3 head. The builder's own option does it (it numbers layers by the one they enter).
    `logits_index`: the graph also takes the positions whose logits a call computes (export/logit_positions.py);
    False leaves the builder's graph as onnxruntime-genai's runtime expects it (the peer benchmark's).
    `cancel`: once set, the builder's process is killed within half a second and ExportError says it was stopped
    (`build --quant auto` stops a candidate's builder when another candidate has failed)."""
    from specpipe.export.features import builder_layers
    from specpipe.export.logit_positions import add_logits_index

    checkpoint_dir, out_dir, cache_dir = Path(checkpoint_dir), Path(out_dir), Path(cache_dir)
    if feature_layers:
        extra_options = {**(extra_options or {}),
                         "aux_hidden_state_layers": ",".join(str(i) for i in builder_layers(feature_layers))}
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ortgenai-input-", dir=cache_dir) as view:
        _checkpoint_view(checkpoint_dir, Path(view))
        argv = builder_argv(Path(view), out_dir, precision, cache_dir, extra_options)
        returncode, stdout, stderr = run_until([sys.executable, "-m", __name__, *argv], timeout_s, cancel,
                                               "onnxruntime-genai's model builder", f"{checkpoint_dir} ({precision})")
    if returncode != 0:
        raise ExportError(f"onnxruntime-genai's model builder failed on {checkpoint_dir} ({precision}): "
                          f"{last_line(stderr or stdout)}")
    if not (out_dir / "genai_config.json").is_file() or not (out_dir / "model.onnx").is_file():
        raise ExportError(f"onnxruntime-genai's model builder wrote no model.onnx/genai_config.json into {out_dir}")
    if logits_index:
        try:
            add_logits_index(out_dir / "model.onnx")
        except ValueError as err:
            raise ExportError(str(err)) from None
    return out_dir


def run_until(command: list[str], timeout_s: float, cancel: Optional[threading.Event], name: str,
              what: str) -> tuple[int, str, str]:
    """`command` (`name`, working on `what`) in a process of its own: (exit code, stdout, stderr); killed past
    `timeout_s` or once `cancel` is set, within CANCEL_POLL_S (ExportError either way)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:  # communicate() again after its timeout loses no output (subprocess docs)
                stdout, stderr = process.communicate(timeout=min(CANCEL_POLL_S, max(deadline - time.monotonic(), 0.01)))
                return process.returncode, stdout, stderr
            except subprocess.TimeoutExpired:
                stopped = cancel is not None and cancel.is_set()
                if stopped or time.monotonic() >= deadline:
                    why = "was stopped" if stopped else f"ran past {timeout_s:.0f} s"
                    raise ExportError(f"{name} {why} on {what}") from None
    finally:
        if process.returncode is None:  # stopped, past its time, or this thread interrupted: the process goes too
            process.kill()
            process.communicate()


def builder_argv(checkpoint_dir: Path, out_dir: Path, precision: Precision, cache_dir: Path,
                 extra_options: Optional[dict[str, str]] = None) -> list[str]:
    """The builder's command line. `extra_options` are its `--extra_options KEY=VALUE` pairs, spelled as
    onnxruntime-genai 0.18 spells them (`python -m onnxruntime_genai.models.builder --help`), e.g.
    block_size, accuracy_level, algo_config, matmul_mixed_precision, nodes_to_exclude, is_symmetric."""
    argv = ["-i", str(checkpoint_dir), "-o", str(out_dir), "-p", precision, "-e", "cpu", "-c", str(cache_dir)]
    if extra_options:
        argv += ["--extra_options", *(f"{key}={value}" for key, value in extra_options.items())]
    return argv


def _checkpoint_view(checkpoint_dir: Path, view: Path) -> None:
    """Symlink every file of the checkpoint into `view`, except config.json, written with rope_scaling filled in."""
    for item in checkpoint_dir.iterdir():
        if item.name != "config.json":
            (view / item.name).symlink_to(item.resolve())
    try:
        config = json.loads((checkpoint_dir / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ExportError(f"{checkpoint_dir}/config.json cannot be read: {err}") from None
    if not config.get("rope_scaling"):
        config["rope_scaling"] = {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
    (view / "config.json").write_text(json.dumps(config, indent=1))


def _install_placeholders() -> None:
    """Give transformers a placeholder for each transformers-5 class the builder imports but never uses here."""
    import transformers

    missing = []
    for name in _TRANSFORMERS_5_NAMES:
        try:
            getattr(transformers, name)
        except (ImportError, AttributeError):
            missing.append(name)
    # transformers' lazy module may have been replaced in sys.modules while the names above were tried:
    # set the placeholders on whatever module `from transformers import X` will now read.
    module = sys.modules["transformers"]
    for name in missing:
        module.__dict__[name] = type(name, (), {"__doc__": "placeholder: a transformers 5 class"})


def _main(argv: list[str]) -> None:
    import runpy

    _install_placeholders()
    sys.argv = [BUILDER_MODULE, *argv]
    runpy.run_module(BUILDER_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
