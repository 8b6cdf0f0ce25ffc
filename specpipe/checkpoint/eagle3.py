"""EAGLE-3 heads as drafts: the one place a folder is recognized as a head and its captured target layers are read.

A head in upstream's format (EAGLE's own, SpecForge, ModelOpt, `specpipe distill`) has no tokenizer and no
causal-LM architecture of its own: config.json names `LlamaForCausalLMEagle3` and, under `eagle_config`, the target
layers whose hidden states it was trained on. Names are in specpipe/engines/upstream.py with their sources.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict

from specpipe.engines import upstream
from specpipe.errors import UsageError


class Eagle3Head(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    architecture: str
    layers_to_capture: Optional[tuple[int, ...]]  # None: the head names none, TensorRT-LLM's default set applies


def is_eagle3_architecture(architecture: str) -> bool:
    return architecture in upstream.EAGLE3_ARCHITECTURES


def read_eagle3_head(spec: str) -> Optional[Eagle3Head]:
    """The head in folder `spec`, or None when `spec` is not an EAGLE-3 head (an alias, a causal LM). A head in
    vLLM speculators' format is refused in one line: TensorRT-LLM's Eagle3 loader does not read it."""
    config_path = Path(spec) / "config.json"
    if not config_path.is_file():
        return None
    config = json.loads(config_path.read_text())
    architecture = (config.get("architectures") or ["unknown"])[0]
    if architecture in upstream.SPECULATORS_ARCHITECTURES:
        raise UsageError(
            f"{spec} is an EAGLE-3 head in vLLM speculators' format ({architecture}); TensorRT-LLM reads heads in"
            f" EAGLE's format ({', '.join(upstream.EAGLE3_ARCHITECTURES)}): convert it, or export it from SpecForge/ModelOpt"
        )
    if not is_eagle3_architecture(architecture):
        return None
    layers = (config.get(upstream.EAGLE3_CONFIG_BLOCK) or {}).get(upstream.EAGLE3_LAYER_IDS_KEY)
    return Eagle3Head(architecture=architecture, layers_to_capture=tuple(int(i) for i in layers) if layers else None)
