"""The openvino peer: OpenVINO GenAI's LLMPipeline on the pair exported by optimum-intel (`optimum-cli export openvino`).

Rows: target alone; draft-model speculative decoding at a fixed K (`num_assistant_tokens`) and with its
dynamic draft length (`assistant_confidence_threshold`, its adaptive mode); prompt lookup
(`prompt_lookup=True`); with an EAGLE-3 head (the deployment's, or `bench --draft HEAD`), the same head in
OpenVINO GenAI's EAGLE-3 pipeline at each fixed K ("openvino eagle3 K=<k>"). CPU device,
`INFERENCE_NUM_THREADS` = the bench's threads. TTFT and acceptance come from the pipeline's own perf metrics.

Compute precision. OpenVINO's CPU plugin computes in bf16 by default where the CPU has AVX512-BF16 or AMX (its
`INFERENCE_PRECISION_HINT`; docs.openvino.ai, "CPU Device", supported inference precisions), whatever the
weights' format. So an fp32 row sets the hint to f32: on an Intel Emerald Rapids (AMX) the fp32 export decoded
20.8 ms a token with the default against 30.4 with f32 (one 64-token generation each, 2026-11-30), and the row had
been labelled fp32 while running bf16. At int8 / int4 the weights are the precision and the activations run at
OpenVINO's default for the machine, which a note names.

The head. optimum-intel exports EAGLE-3 heads (`LlamaForCausalLMEagle3`, upstream's checkpoint format, which
specpipe's heads are) from 2.0 on, which needs optimum 2.2 while optimum-onnx 0.1 (specpipe's exporter) pins
optimum 2.1: the two cannot share one environment, so the head's export runs in its own
(`make install-peers` makes `.venv-ov-export`; `SPECPIPE_OV_EXPORT_PYTHON` names another). Its
`--trust-remote-code` loads optimum-intel's own head class (its `update_config_for_eagle3` points the config's
auto_map at optimum-intel's model_patcher), not code from the checkpoint. The export leaves the
head's embedding table at its initial values: OpenVINO GenAI copies the target's into the draft when it loads
the pair ("Copying embedding weights from main to draft model"). The head is exported in fp32 at every precision
(~10M weights: its step is a small share of a target step), so a precision's rows differ only in the target.

Which target layers: GenAI reads `hidden_layers_list` from the draft IR's rt_info, else uses
{2, N/2, N-3}. It finds layer i's output as the residual Add after the MLP of the nodes named "layers.<i>/"
(openvinotoolkit/openvino.genai src/cpp/src/speculative_decoding/eagle3_model_transforms.cpp,
`find_decoder_layer_hidden_state_outputs`, at da1db864d2bc1a265e9a036f5b57ef13f0e86c2c): the output of 0-based
decoder layer i, the SGLang / TensorRT-LLM convention specpipe's heads record. So the export writes the head's own
layers there. Measured (docs/benchmarks.md): a SmolLM2 head with its layers accepted 0.72 at K=1; with layers
5, 10, 20 planted, 0.20.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

from specpipe.bench.harness import Measurement
from specpipe.bench.peers.common import PeerPair, PeerRow, cached_conversion, cut_at_eos, package_version, run_tool
from specpipe.errors import ExportError

# OpenVINO GenAI's documented settings for its two self-tuning modes (its speculative/prompt-lookup samples).
ADAPTIVE = {"assistant_confidence_threshold": 0.4}
PROMPT_LOOKUP = {"num_assistant_tokens": 5, "max_ngram_size": 3}
WEIGHT_FORMAT = {"fp32": "fp32", "int8": "int8", "int4": "int4"}
INT4_GROUP_SIZES = (128, 64, 32)  # NNCF's default group first


def export_options(checkpoint_dir: Path, precision: str) -> list[str]:
    """int4: NNCF's default group of 128 weights does not divide every model's widths (SmolLM2's 576: the export fails,
    and optimum-intel 1.27 does not pass --group-size-fallback on to NNCF), so the largest of 128, 64, 32 that divides
    the hidden and MLP widths is named."""
    if precision != "int4":
        return []
    config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    widths = [int(config[key]) for key in ("hidden_size", "intermediate_size") if key in config]
    for group in INT4_GROUP_SIZES:
        if all(width % group == 0 for width in widths):
            return ["--group-size", str(group)] if group != INT4_GROUP_SIZES[0] else []
    return ["--group-size-fallback", "adjust"]


def export(checkpoint_dir: Path, precision: str) -> Path:
    """optimum-intel's export of a checkpoint (stateful OpenVINO IR with the KV cache, plus its tokenizer), cached."""
    options = export_options(checkpoint_dir, precision)
    tool = " ".join([f"optimum-intel {package_version('optimum-intel')} openvino {package_version('openvino')}", *options])

    def convert(out: Path) -> None:
        run_tool(["-m", "optimum.commands.optimum_cli", "export", "openvino", "--model", str(checkpoint_dir),
                  "--task", "text-generation-with-past", "--weight-format", WEIGHT_FORMAT[precision], *options, str(out)],
                 f"optimum-intel's export of {checkpoint_dir} ({precision})")

    return cached_conversion("openvino", checkpoint_dir, precision, tool, convert)


# optimum-intel's first release that exports EAGLE-3 heads, and the packages its export needs beside it
HEAD_EXPORTER = ("optimum-intel[openvino]==2.0.0", "transformers==4.57.6", "einops")
EXPORT_PYTHON_ENV = "SPECPIPE_OV_EXPORT_PYTHON"
EXPORT_VENV = ".venv-ov-export"  # beside specpipe's own .venv, made by `make install-peers`


def head_export_python() -> Optional[Path]:
    """The Python whose optimum-intel exports EAGLE-3 heads: $SPECPIPE_OV_EXPORT_PYTHON, else the project's
    .venv-ov-export; None when neither exists."""
    named = os.environ.get(EXPORT_PYTHON_ENV)
    if named:
        return Path(named) if Path(named).is_file() else None
    for root in (Path.cwd(), Path(__file__).resolve().parents[3]):
        python = root / EXPORT_VENV / "bin" / "python"
        if python.is_file():
            return python
    return None


def export_head(head_dir: Path, layers: tuple[int, ...]) -> Path:
    """The EAGLE-3 head as OpenVINO GenAI's draft: optimum-intel's export (in its own environment), then the target
    layers it reads written into the IR's rt_info (`hidden_layers_list`, which GenAI reads). Cached per weights,
    layers and exporter."""
    python = head_export_python()
    if python is None:
        raise ExportError(f"exporting an EAGLE-3 head needs optimum-intel >= 2.0 in its own environment (it cannot "
                          f"share specpipe's optimum): `make install-peers` makes {EXPORT_VENV}, or set "
                          f"{EXPORT_PYTHON_ENV}")
    if len(layers) != 3:
        raise ExportError(f"OpenVINO GenAI's EAGLE-3 reads exactly 3 target layers; this head reads {list(layers)}")
    tool = f"{' '.join(HEAD_EXPORTER)} layers {','.join(map(str, layers))} openvino {package_version('openvino')}"

    def convert(out: Path) -> None:
        import openvino as ov

        run_tool(["-m", "optimum.commands.optimum_cli", "export", "openvino", "--model", str(head_dir),
                  "--task", "text-generation-with-past", "--weight-format", "fp32", "--trust-remote-code", str(out)],
                 f"optimum-intel's export of the EAGLE-3 head {head_dir}", python=python)
        xml = out / "openvino_model.xml"
        model = ov.Core().read_model(xml)
        if not model.has_rt_info("eagle3_mode"):
            raise ExportError(f"optimum-intel exported {head_dir} without eagle3_mode: not an EAGLE-3 draft for GenAI")
        model.set_rt_info(" ".join(str(i) for i in layers), "hidden_layers_list")
        staged = out / "staged"
        ov.save_model(model, staged / "openvino_model.xml", compress_to_fp16=False)
        del model
        for name in ("openvino_model.xml", "openvino_model.bin"):
            (staged / name).replace(out / name)
        staged.rmdir()

    return cached_conversion("openvino", head_dir, "eagle3", tool, convert)


def head_layers_of(draft_dir: Path) -> list[int]:
    """The target layers an exported draft's rt_info names (what GenAI will read), or [] when it names none."""
    import openvino as ov

    model = ov.Core().read_model(Path(draft_dir) / "openvino_model.xml")
    if not model.has_rt_info("hidden_layers_list"):
        return []
    return [int(i) for i in model.get_rt_info("hidden_layers_list").astype(str).split()]


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


def properties(precision: str, threads: int) -> dict:
    """The CPU plugin's properties for every pipeline of a precision's rows (module docstring: compute precision)."""
    props = {"INFERENCE_NUM_THREADS": threads}
    if precision == "fp32":
        props["INFERENCE_PRECISION_HINT"] = "f32"
    return props


def default_precision() -> str:
    import openvino as ov

    return ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name()


def rows(pair: PeerPair) -> tuple[list[PeerRow], list[str]]:
    import openvino_genai as ovg

    eos = list(pair.eos_token_ids)
    props = properties(pair.precision, pair.threads)
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
    notes = [] if "INFERENCE_PRECISION_HINT" in props else [f"{p} weights, activations in {default_precision()} "
                                                            f"(OpenVINO's default on this CPU)"]
    if pair.head_dir is not None:
        try:
            head = ovg.draft_model(str(export_head(pair.head_dir, pair.head_layers)), "CPU", **props)
            eagle = ovg.LLMPipeline(target, "CPU", draft_model=head, **props)
        except Exception as err:  # the export, or GenAI refusing the pair: the other rows stay
            notes.append(f"eagle3 rows skipped: {(str(err).strip().splitlines() or [type(err).__name__])[0]}")
        else:
            for k in pair.draft_lengths:  # GenAI's EAGLE-3 takes a fixed K only (no confidence threshold)
                out.append(PeerRow(f"openvino eagle3 K={k}", "openvino", "eagle3-head", k, p,
                                   OVGenerate(eagle, eos, True, num_assistant_tokens=k)))
    lookup = ovg.LLMPipeline(target, "CPU", prompt_lookup=True, **props)
    out.append(PeerRow("openvino prompt-lookup", "openvino", "prompt-lookup", None, p,
                       OVGenerate(lookup, eos, False, **PROMPT_LOOKUP), PROMPT_LOOKUP))
    return out, notes
