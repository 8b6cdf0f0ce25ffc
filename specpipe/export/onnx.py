"""Export a causal LM to ONNX with optimum (task `text-generation-with-past`) and check the engine.

One exported graph serves prefill, single-token decode and the K+1-token verify step: it takes any
number of new tokens on top of a (possibly empty) KV cache.
"""

from __future__ import annotations

import contextlib
import io
import logging
import shutil
import warnings
from pathlib import Path

import numpy as np

from specpipe.errors import ExportError, ExportMismatchError

TASK = "text-generation-with-past"


def export_onnx(checkpoint_dir: Path, out_dir: Path) -> Path:
    """Export `checkpoint_dir` into `out_dir` (model.onnx [+ external data]). Returns out_dir."""
    from optimum.exporters.onnx import main_export

    out_dir = Path(out_dir)
    with _quiet():
        try:
            main_export(
                str(checkpoint_dir),
                output=out_dir,
                task=TASK,
                do_validation=False,  # our own check below compares against torch on the KV path
                local_files_only=True,
                trust_remote_code=False,
            )
        except Exception as exc:
            raise ExportError(f"optimum could not export {checkpoint_dir}: {str(exc).splitlines()[0]}") from None
    if not (out_dir / "model.onnx").is_file():
        raise ExportError(f"optimum wrote no model.onnx for {checkpoint_dir}")
    return out_dir


def onnx_weight_files(folder: Path) -> list[Path]:
    """model.onnx and its external-data files (everything optimum wrote that is not config/tokenizer)."""
    return sorted(p for p in Path(folder).iterdir() if p.is_file() and (p.suffix in {".onnx", ".data"} or "onnx" in p.name))


def copy_onnx(src_dir: Path, dst_dir: Path) -> None:
    dst_dir.mkdir(parents=True, exist_ok=True)
    for p in onnx_weight_files(src_dir):
        shutil.copy2(p, dst_dir / p.name)


def reference_inputs(vocab_size: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """A fixed prompt and a 3-token continuation: exercises prefill and the multi-token KV path."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab_size, size=15).tolist()
    return ids[:12], ids[12:]


def check_export(model, engine, *, tolerance: float, name: str) -> float:
    """Max |logit difference| between the torch `model` and `engine` on the reference input.

    Runs the engine as the decoder does (prefill, then 3 tokens on top of the cache) and the torch model
    on the whole sequence at once; a sliced head (engine.token_ids) is compared on its own columns.
    Raises ExportMismatchError above `tolerance`.
    """
    import torch

    prompt, more = reference_inputs(engine.vocab_size)
    seq = engine.new_sequence()
    engine_logits = np.concatenate([seq.append(prompt), seq.append(more)])
    with torch.no_grad():
        torch_logits = model(torch.tensor([prompt + more])).logits[0].float().numpy()
    columns = engine.token_ids if engine.token_ids is not None else slice(0, engine_logits.shape[1])
    max_abs_diff = float(np.abs(engine_logits - torch_logits[:, columns]).max())
    if not np.isfinite(max_abs_diff) or max_abs_diff > tolerance:
        raise ExportMismatchError(name, max_abs_diff, tolerance)
    return max_abs_diff


@contextlib.contextmanager
def _quiet():
    """optimum and torch.onnx print tracer warnings by the page; keep them out of the user's terminal."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        level = logging.root.manager.disable
        logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(level)
