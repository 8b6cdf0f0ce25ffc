"""HF checkpoint -> ONNX through onnxruntime-genai's model builder (GroupQueryAttention, shared KV buffer).

Why the builder and not optimum for the target: its graph fuses attention into GroupQueryAttention over a KV
buffer that past and present share, so a step writes only its new entries, rows of different lengths batch
in one call, and a rollback copies nothing (engines/shared_kv.py). optimum's graph concatenates past and
present and expands the cache per query head on every step: on the AVX2 machine, 16 rows x 256 cached
tokens took 613 ms a step against 86 ms for the builder's graph (README, "Continuous batching").
Its int4 (`precision="int4"`) also quantizes the tied lm_head, which our export leaves in fp32.

Compatibility (onnxruntime-genai 0.18.0 with transformers 4.57, which specpipe pins because optimum-onnx
needs < 4.58): the builder imports a few model classes that only transformers 5 has, and reads rope
settings from `rope_scaling` the way transformers 5 lays them out. The child process below gives it
placeholder classes for the missing names (they are only used for other architectures) and a copy of the
checkpoint's config with `rope_scaling` set to the default rope; the weights are symlinked, not copied.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from specpipe.errors import ExportError

PRECISIONS = ("fp32", "int4")
# Names base.py imports from transformers that 4.57 lacks; placeholders are enough for Llama-family models.
_TRANSFORMERS_5_ONLY = (
    "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration", "Qwen3VLForConditionalGeneration",
    "Lfm2VlForConditionalGeneration", "Gemma3ForConditionalGeneration", "Mistral3ForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
)
_CHILD = """
import runpy, sys
names = {names!r}
for name in names:
    try:
        exec("from transformers import " + name)
    except ImportError:
        pass
transformers = sys.modules["transformers"]  # importing some of the names above replaces the module object
for name in names:
    try:
        getattr(transformers, name)
    except Exception:
        transformers.__dict__[name] = type(name, (), {{}})
sys.argv = ["onnxruntime_genai.models.builder"] + sys.argv[1:]
runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__")
"""


def builder_available() -> bool:
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return False
    return True


def run_model_builder(checkpoint: Path, out_dir: Path, *, precision: str = "fp32", extra: dict | None = None) -> Path:
    """Write model.onnx (+ model.onnx.data) for `checkpoint` into `out_dir`; returns the model path.

    `extra`: the builder's `--extra_options` (e.g. {"int4_accuracy_level": 4})."""
    if precision not in PRECISIONS:
        raise ExportError(f"the model builder path takes precision {' or '.join(PRECISIONS)}, not {precision!r}")
    if not builder_available():
        raise ExportError("onnxruntime-genai is not installed (pip install onnxruntime-genai)")
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    with tempfile.TemporaryDirectory(prefix="specpipe-builder-") as tmp:
        source = Path(tmp) / "checkpoint"
        source.mkdir()
        for item in checkpoint.iterdir():
            if item.name != "config.json":
                os.symlink(item.resolve(), source / item.name)
        config = json.loads((checkpoint / "config.json").read_text())
        if not config.get("rope_scaling"):
            config["rope_scaling"] = {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
        (source / "config.json").write_text(json.dumps(config))
        staged = Path(tmp) / "out"
        cmd = [sys.executable, "-c", _CHILD.format(names=_TRANSFORMERS_5_ONLY), "-i", str(source), "-m", str(source),
               "-o", str(staged), "-p", precision, "-e", "cpu", "-c", str(Path(tmp) / "cache")]
        if extra:
            cmd += ["--extra_options", *(f"{k}={v}" for k, v in extra.items())]
        env = {**os.environ, "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        model = staged / "model.onnx"
        if proc.returncode != 0 or not model.is_file():
            lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
            raise ExportError(f"onnxruntime-genai's model builder failed: {lines[-1] if lines else proc.returncode}")
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in ("model.onnx", "model.onnx.data"):
            if (staged / name).exists():
                shutil.move(str(staged / name), out_dir / name)
    return out_dir / "model.onnx"
