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
                             lambda out: run_model_builder(checkpoint_dir, out, precision, scratch))


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
