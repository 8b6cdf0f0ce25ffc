"""The openvino peer: OpenVINO GenAI's LLMPipeline on the pair exported by optimum-intel (`optimum-cli export openvino`).

Rows: target alone; draft-model speculative decoding at a fixed K (`num_assistant_tokens`) and with its
dynamic draft length (`assistant_confidence_threshold`, its adaptive mode); prompt lookup
(`prompt_lookup=True`). CPU device, `INFERENCE_NUM_THREADS` = the bench's threads. TTFT and acceptance
come from the pipeline's own perf metrics.
"""

from __future__ import annotations

import time
from pathlib import Path

from specpipe.bench.harness import Measurement
from specpipe.bench.peers.common import PeerPair, PeerRow, cached_conversion, cut_at_eos, package_version, run_tool

# OpenVINO GenAI's documented settings for its two self-tuning modes (its speculative/prompt-lookup samples).
ADAPTIVE = {"assistant_confidence_threshold": 0.4}
PROMPT_LOOKUP = {"num_assistant_tokens": 5, "max_ngram_size": 3}
WEIGHT_FORMAT = {"fp32": "fp32", "int8": "int8", "int4": "int4"}


def export(checkpoint_dir: Path, precision: str) -> Path:
    """optimum-intel's export of a checkpoint (stateful OpenVINO IR with the KV cache, plus its tokenizer), cached."""
    tool = f"optimum-intel {package_version('optimum-intel')} openvino {package_version('openvino')}"

    def convert(out: Path) -> None:
        run_tool(["-m", "optimum.commands.optimum_cli", "export", "openvino", "--model", str(checkpoint_dir),
                  "--task", "text-generation-with-past", "--weight-format", WEIGHT_FORMAT[precision], str(out)],
                 f"optimum-intel's export of {checkpoint_dir} ({precision})")

    return cached_conversion("openvino", checkpoint_dir, precision, tool, convert)


class OVGenerate:
    def __init__(self, pipe, eos_token_ids: list[int], speculative: bool, **settings):
        self.pipe, self.eos_token_ids, self.speculative, self.settings = pipe, eos_token_ids, speculative, settings

    def __call__(self, prompt_ids: list[int], max_new_tokens: int) -> Measurement:
        import numpy as np
        import openvino as ov
        import openvino_genai as ovg

        config = ovg.GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, **self.settings)
        config.eos_token_id = self.eos_token_ids[0]
        config.stop_token_ids = set(self.eos_token_ids)
        start = time.perf_counter()
        result = self.pipe.generate(ov.Tensor(np.array([prompt_ids], dtype=np.int64)), config)
        total_ms = (time.perf_counter() - start) * 1e3
        ids = cut_at_eos(list(result.tokens[0]), self.eos_token_ids)
        measurement = Measurement(prompt_id="", num_generated=len(ids), total_ms=total_ms,
                                  ttft_ms=float(result.perf_metrics.get_ttft().mean), token_ids=ids)
        metrics = result.extended_perf_metrics if self.speculative else None
        if metrics is not None:  # speculative decoding reports its drafts; prompt lookup reports none
            measurement.drafted = int(metrics.get_num_draft_tokens())
            measurement.accepted = int(metrics.get_num_accepted_tokens())
        return measurement


def rows(pair: PeerPair) -> tuple[list[PeerRow], list[str]]:
    import openvino_genai as ovg

    eos = list(pair.eos_token_ids)
    props = {"INFERENCE_NUM_THREADS": pair.threads}
    target = str(export(pair.target_dir, pair.precision))
    p = pair.precision
    out = [PeerRow("openvino target-only", "openvino", "target-only", None, p,
                   OVGenerate(ovg.LLMPipeline(target, "CPU", **props), eos, False))]
    if pair.draft_dir is not None:
        draft = ovg.draft_model(str(export(pair.draft_dir, pair.precision)), "CPU", **props)
        speculative = ovg.LLMPipeline(target, "CPU", draft_model=draft, **props)
        for k in pair.draft_lengths:
            out.append(PeerRow(f"openvino K={k}", "openvino", "draft-model", k, p,
                               OVGenerate(speculative, eos, True, num_assistant_tokens=k)))
        out.append(PeerRow("openvino adaptive", "openvino", "draft-model", None, p,
                           OVGenerate(speculative, eos, True, **ADAPTIVE), ADAPTIVE))
    lookup = ovg.LLMPipeline(target, "CPU", prompt_lookup=True, **props)
    out.append(PeerRow("openvino prompt-lookup", "openvino", "prompt-lookup", None, p,
                       OVGenerate(lookup, eos, False, **PROMPT_LOOKUP), PROMPT_LOOKUP))
    return out, []
