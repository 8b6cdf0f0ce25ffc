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
# Every tensor of a one-layer Llama EAGLE-3 head, as the loaders read them:
# - TensorRT-LLM tensorrt_llm/_torch/models/modeling_speculative.py @b35ac1b64368513d215c57d2ed01d62d910df8da:
#   Eagle3DraftModel has fc (Linear 3H -> H, bias only if config.bias), midlayer (Eagle3DecoderLayer: input_layernorm
#   on the embedding, hidden_norm on the state, self_attn with q/k/v reading 2H, fused on load as FUSED_QKV_LINEAR,
#   post_attention_layernorm, mlp gate/up/down), norm, d2t (only when draft_vocab_size != vocab_size);
#   Eagle3ForCausalLM.load_weights prefixes "model." to every key but lm_head.*, and takes lm_head from the target
#   when the head has none. No embed_tokens unless target_hidden_size differs from hidden_size.
# - vLLM vllm/model_executor/models/llama_eagle3.py @583507d13075783a12ccbd774575974d10ca4959: load_weights skips
#   "t2d", renames "d2t" to draft_id_to_target_id (logits of draft id d go to target id d + d2t[d]), prefixes
#   "model." to the rest and maps "midlayer." to "layers.0."; an unknown key is a KeyError (params_dict[name]).
# - SGLang python/sglang/srt/models/llama_eagle3.py @d737979cbd17c6162f39c1953cfa72d3d23cc0d0: LlamaModel has fc,
#   midlayer, norm (prefixed "model." on load), lm_head of draft_vocab_size rows (tie_word_embeddings true would make
#   it the embedding: heads write false); load_weights turns d2t into hot_token_id = d2t + arange and skips t2d;
#   names it does not know are skipped silently (so only the two loaders above catch a misspelt key).
EAGLE3_HEAD_TENSORS = (
    "fc.weight",
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    "norm.weight", "lm_head.weight", "d2t", "t2d",
)  # fmt: skip
EAGLE3_DRAFT_VOCAB_KEY = "draft_vocab_size"  # config.json; TensorRT-LLM and vLLM size lm_head and d2t by it
# vLLM speculators' format names this architecture; TensorRT-LLM's Eagle3 loader does not read it.
SPECULATORS_ARCHITECTURES = ("Eagle3Speculator",)


class Eagle3Head(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    architecture: str
    layers_to_capture: Optional[tuple[int, ...]]  # None: the head names none, TensorRT-LLM's default set applies
    draft_vocab_size: Optional[int] = None  # None: the head scores the target's whole vocabulary


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
    draft_vocab = config.get(EAGLE3_DRAFT_VOCAB_KEY)
    return Eagle3Head(architecture=architecture, layers_to_capture=tuple(int(i) for i in layers) if layers else None,
                      draft_vocab_size=int(draft_vocab) if draft_vocab else None)


WEIGHTS_FILE = "model.safetensors"


def head_config(shape, *, dtype: str = "float32") -> dict:
    """config.json of a one-layer Llama EAGLE-3 head (`shape`: specpipe.distill.eagle3.HeadShape). The captured
    layers go under eagle_config in layer-output ids (SGLang / SpecForge / TensorRT-LLM numbering,
    export/features.py); no top-level `eagle_aux_hidden_state_layer_ids`: vLLM reads that key as layer-*input* ids,
    one off, and with it absent uses its default (2, N/2, N-3), the same tensors as the default here."""
    return {
        "architectures": [EAGLE3_ARCHITECTURES[0]],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "target_hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": shape.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": shape.vocab_size,
        EAGLE3_DRAFT_VOCAB_KEY: shape.draft_vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        EAGLE3_CONFIG_BLOCK: {EAGLE3_LAYER_IDS_KEY: list(shape.feature_layers),
                                       "use_aux_hidden_state": True},
    }


def write_eagle3_head(folder: Path, tensors: dict, config: dict) -> Path:
    """folder/config.json + folder/model.safetensors with exactly EAGLE3_HEAD_TENSORS (no embed_tokens)."""
    import torch
    from safetensors.torch import save_file

    missing = [name for name in EAGLE3_HEAD_TENSORS if name not in tensors]
    extra = [name for name in tensors if name not in EAGLE3_HEAD_TENSORS]
    if missing or extra:
        raise ValueError(f"an EAGLE-3 head has exactly {EAGLE3_HEAD_TENSORS}; missing {missing}, extra {extra}")
    dtype = getattr(torch, config.get("torch_dtype", "float32"))
    out = {name: (t.detach().cpu().to(dtype) if t.is_floating_point() else t.detach().cpu()).contiguous()
           for name, t in tensors.items()}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(out, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def load_eagle3_tensors(folder: Path) -> dict:
    """The head's tensors by upstream name; refuses a file that lacks one (a TensorRT-LLM or vLLM load would fail)."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(folder) / WEIGHTS_FILE))
    missing = [name for name in EAGLE3_HEAD_TENSORS if name != "t2d" and name not in tensors]
    if missing:
        raise UsageError(f"{folder} is not a complete EAGLE-3 head: no {', '.join(missing)}")
    return tensors
