"""The ortgenai peer: onnxruntime-genai's Generator on graphs from its own model builder (specpipe.export.ortgenai_builder).

Rows: target alone; draft-model speculative decoding (a `model.draft` decoder block added to the
target's genai_config) at a fixed K (`max_draft_tokens`) and with its adaptive width
(`min_adaptive_k`); n-gram prompt lookup (`ngram_size`). Session threads = the bench's threads.
Acceptance: its speculative stats, drafted = `draft_tokens_proposed`, accepted = `draft_tokens_accepted`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from specpipe.bench.harness import Measurement
from specpipe.bench.peers.common import PeerPair, PeerRow, cached_conversion, package_version, with_eos

# Its speculative-decoding guide's starting points for the two self-tuning modes.
ADAPTIVE = {"min_adaptive_k": 2}
PROMPT_LOOKUP = {"ngram_size": 3, "max_draft_tokens": 4, "min_adaptive_k": 2}


def build(checkpoint_dir: Path, precision: str) -> Path:
    """The model builder's graph and genai_config.json for a checkpoint, cached."""
    from specpipe.checkpoint.cache import cache_dir
    from specpipe.export.ortgenai_builder import run_model_builder

    tool = f"onnxruntime-genai {package_version('onnxruntime-genai')} transformers {package_version('transformers')}"
    scratch = cache_dir() / "peers" / "ortgenai-scratch"
    return cached_conversion("ortgenai", checkpoint_dir, precision, tool,
                             lambda out: run_model_builder(checkpoint_dir, out, precision, scratch, logits_index=False))


def _session_options(threads: int) -> dict:
    return {"log_id": "onnxruntime-genai", "provider_options": [], "intra_op_num_threads": threads,
            "inter_op_num_threads": 1}


def load_model(target_dir: Path, threads: int, draft_dir: Path | None = None):
    """og.Model of the target (and the draft, as the composite config's `model.draft`) with the bench's threads."""
    import onnxruntime_genai as og

    session = _session_options(threads)
    overlay: dict = {"model": {"decoder": {"session_options": session}}}
    if draft_dir is not None:
        draft = json.loads((draft_dir / "genai_config.json").read_text())["model"]["decoder"]
        draft["filename"] = os.path.relpath(draft_dir / draft["filename"], target_dir)
        draft["session_options"] = session  # target and draft must share providers and options
        overlay["model"]["draft"] = draft
    config = og.Config(str(target_dir))
    config.overlay(json.dumps(overlay))
    return og.Model(config)


class OGGenerate:
    def __init__(self, model, eos_token_ids: list[int], **speculative):
        self.model, self.eos_token_ids, self.speculative = model, eos_token_ids, speculative

    def __call__(self, prompt_ids: list[int], max_new_tokens: int) -> Measurement:
        import onnxruntime_genai as og

        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(prompt_ids) + max_new_tokens, do_sample=False)
        if self.speculative:
            params.set_speculative_options(**self.speculative)
        start = time.perf_counter()
        generator = og.Generator(self.model, params)
        generator.append_tokens(prompt_ids)
        first_token_at = None
        while not generator.is_done():
            generator.generate_next_token()
            first_token_at = first_token_at or time.perf_counter()
        total_ms = (time.perf_counter() - start) * 1e3
        new_ids = list(generator.get_sequence(0))[len(prompt_ids) :]
        ids = with_eos(new_ids, self.eos_token_ids, stopped_on_eos=len(new_ids) < max_new_tokens)
        measurement = Measurement(prompt_id="", num_generated=len(ids), total_ms=total_ms,
                                  ttft_ms=((first_token_at or time.perf_counter()) - start) * 1e3, token_ids=ids)
        if self.speculative:
            stats = generator.get_speculative_stats()
            measurement.drafted = int(stats["draft_tokens_proposed"])
            measurement.accepted = int(stats["draft_tokens_accepted"])
        return measurement


def accuracy(pair: PeerPair, token_batches) -> tuple[object, str]:
    """Its builder's target graph at the pair's precision against its fp32 graph, by specpipe's accuracy check:
    both graphs are the shared-KV kind specpipe's engines run (engines/shared_kv.py), opened through a view
    folder with the engine.json specpipe's loader reads. Returns (AccuracyReport, the model's name)."""
    import tempfile

    from specpipe.quantize.accuracy import measure_accuracy

    name = f"its builder's default {pair.precision}"
    with tempfile.TemporaryDirectory(prefix="ortgenai-accuracy-") as views:
        reference = _engine_view(build(pair.target_dir, "fp32"), pair.target_dir, Path(views) / "fp32", "none")
        quantized = _engine_view(build(pair.target_dir, pair.precision), pair.target_dir, Path(views) / "quant", name)
        return measure_accuracy(reference, quantized, token_batches, threads=pair.threads), name


def _engine_view(model_dir: Path, checkpoint_dir: Path, view: Path, quant: str) -> Path:
    """`view`: links to the builder's model files and the engine.json specpipe's loader needs."""
    from specpipe.checkpoint import inspect_checkpoint
    from specpipe.engines.onnxruntime import write_engine_meta
    from specpipe.engines.shared_kv import KV_LAYOUT
    from specpipe.quantize.graph import model_files

    view.mkdir(parents=True)
    for path in model_files(model_dir):
        (view / path.name).symlink_to(path.resolve())
    info = inspect_checkpoint(checkpoint_dir)
    write_engine_meta(view, vocab_size=info.vocab_size, num_layers=info.num_layers, num_kv_heads=info.num_kv_heads,
                      head_dim=info.head_dim, max_seq_len=1024, quant=quant, kv_layout=KV_LAYOUT)
    return view


def rows(pair: PeerPair) -> tuple[list[PeerRow], list[str]]:
    eos, p = list(pair.eos_token_ids), pair.precision
    target_dir = build(pair.target_dir, p)
    target = load_model(target_dir, pair.threads)
    out = [PeerRow("ortgenai target-only", "ortgenai", "target-only", None, p, OGGenerate(target, eos))]
    if pair.draft_dir is not None:
        composite = load_model(target_dir, pair.threads, build(pair.draft_dir, p))
        for k in pair.draft_lengths:
            out.append(PeerRow(f"ortgenai K={k}", "ortgenai", "draft-model", k, p,
                               OGGenerate(composite, eos, max_draft_tokens=k)))
        out.append(PeerRow("ortgenai adaptive", "ortgenai", "draft-model", None, p,
                           OGGenerate(composite, eos, **ADAPTIVE), ADAPTIVE))
    out.append(PeerRow("ortgenai prompt-lookup", "ortgenai", "prompt-lookup", None, p,
                       OGGenerate(target, eos, **PROMPT_LOOKUP), PROMPT_LOOKUP))
    return out, []
