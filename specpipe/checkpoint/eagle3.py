"""EAGLE-3 heads as drafts: the one place a folder is recognized as a head and its captured target layers are read.

A head in upstream's format (EAGLE's own, SpecForge, ModelOpt, `specpipe distill`) has no tokenizer and no
causal-LM architecture of its own: config.json names `LlamaForCausalLMEagle3` and, under `eagle_config`, the target
layers whose hidden states it was trained on. The format's names are defined here (checkpoint stage);
engines/upstream.py lists them beside TensorRT-LLM's other names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict

from specpipe.errors import UsageError

# An EAGLE-3 head's config.json names this architecture (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, the head the
# EagleDecodingConfig docstring cites).
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3",)
# Where such a head names the target layers it was trained on: eagle_config.eagle_aux_hidden_state_layer_ids
# (the key SpecForge and ModelOpt write into the head's config.json; specpipe distill writes the same). The
# head's tensors in that format: fc.weight, midlayer.* (one decoder layer), norm.weight, lm_head.weight, d2t, t2d.
EAGLE3_CONFIG_BLOCK = "eagle_config"
EAGLE3_LAYER_IDS_KEY = "eagle_aux_hidden_state_layer_ids"
EAGLE3_TENSORS = ("fc.weight", "midlayer.self_attn.q_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")
# vLLM speculators' format names this architecture; TensorRT-LLM's Eagle3 loader does not read it.
SPECULATORS_ARCHITECTURES = ("Eagle3Speculator",)


class Eagle3Head(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    architecture: str
    layers_to_capture: Optional[tuple[int, ...]]  # None: the head names none, TensorRT-LLM's default set applies


def is_eagle3_architecture(architecture: str) -> bool:
    return architecture in EAGLE3_ARCHITECTURES


def read_eagle3_head(spec: str) -> Optional[Eagle3Head]:
    """The head in folder `spec`, or None when `spec` is not an EAGLE-3 head (an alias, a causal LM). A head in
    vLLM speculators' format is refused in one line: TensorRT-LLM's Eagle3 loader does not read it."""
    config_path = Path(spec) / "config.json"
    if not config_path.is_file():
        return None
    config = json.loads(config_path.read_text())
    architecture = (config.get("architectures") or ["unknown"])[0]
    if architecture in SPECULATORS_ARCHITECTURES:
        raise UsageError(
            f"{spec} is an EAGLE-3 head in vLLM speculators' format ({architecture}); TensorRT-LLM reads heads in"
            f" EAGLE's format ({', '.join(EAGLE3_ARCHITECTURES)}): convert it, or export it from SpecForge/ModelOpt"
        )
    if not is_eagle3_architecture(architecture):
        return None
    layers = (config.get(EAGLE3_CONFIG_BLOCK) or {}).get(EAGLE3_LAYER_IDS_KEY)
    return Eagle3Head(architecture=architecture, layers_to_capture=tuple(int(i) for i in layers) if layers else None)
