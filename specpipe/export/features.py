"""Target features for EAGLE-3 heads: which residual-stream tensors a head reads, in each upstream's numbering.

An EAGLE-3 head reads the target's residual stream (the un-normed sum of the embedding and every layer's
output so far) at three depths, concatenated into [tokens, 3 * hidden]. Upstreams number those depths two ways:

- **layer-output ids** (what a head's config.json names under eagle_config.eagle_aux_hidden_state_layer_ids, and
  what specpipe uses everywhere): id i = the residual stream *after* decoder layer i (0-based). Default (1, N/2-1,
  N-4): for SmolLM2's 30 layers (1, 14, 26).
  * TensorRT-LLM: tensorrt_llm/_torch/speculative/eagle3.py @001e67005b4f64b69b0045456870be48ab7b2cf0,
    Eagle3SpecMetadata.__post_init__ `self.layers_to_capture = (1, self.num_layers // 2 - 1, self.num_layers - 4)`;
    maybe_capture_hidden_states(layer_id, hidden_states, residual) saves `hidden_states + residual` and the
    decoder layer calls it with its own layer_idx at the end of its forward (after the MLP): the layer's output.
  * SGLang: python/sglang/srt/models/llama.py @00239548f1cd1a06ca145a5447a86738090a48f1,
    set_eagle3_layers_to_capture: `self.model.layers_to_capture = [val + 1 for val in layer_ids]` ("for the ith
    layer, it takes the output of the (i-1)th layer"), and LlamaModel.forward appends `hidden_states + residual`
    *before* running layer i; its own default [2, N // 2, N - 3] is (1, N/2-1, N-4) in layer-output ids.
    SpecForge trains heads in this numbering and writes it into the head's config.
- **layer-input ids** (vLLM and vLLM speculators; onnxruntime-genai's builder): id j = the residual stream
  *entering* layer j = layer-output id j - 1 (0 would be the embedding).
  * vLLM: vllm/model_executor/models/llama.py @e06c9ba2a6ea923a84add30f5dafaea126429b81, LlamaModel.forward
    `if idx in self.aux_hidden_state_layers: aux_hidden_states.append(hidden_states + residual)` before layer idx
    runs; get_eagle3_aux_hidden_state_layers() -> (2, num_layers // 2, num_layers - 3): the same tensors as above.
  * onnxruntime-genai 0.18 builder (onnxruntime_genai/models/builders/base.py, extra option
    aux_hidden_state_layers): "Entry `i` is the residual stream entering layer i, so indices must lie in
    [1, num_hidden_layers)"; its block-drafter path adds one to SpecForge's target_layer_ids for the same reason.

Hugging Face's `output_hidden_states` tuple is layer-input numbered too: hidden_states[0] is the embedding,
hidden_states[k] the output of layer k-1 (the last entry has the final norm applied; no default id reaches it).
"""

from __future__ import annotations

from typing import Sequence

FEATURE_OUTPUT = "aux_hidden_states"  # the builder's output name: [batch, new tokens, hidden * len(layers)]
EAGLE3_MIN_LAYERS = 6  # TensorRT-LLM refuses the default capture at <= 5 layers ("Not enough hidden layers")


def default_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default capture, in layer-output ids (module docstring): (1, N/2-1, N-4)."""
    if num_layers < EAGLE3_MIN_LAYERS:
        raise ValueError(f"EAGLE-3's default feature layers need >= {EAGLE3_MIN_LAYERS} target layers, got {num_layers}")
    return (1, num_layers // 2 - 1, num_layers - 4)


def check_layers(layer_ids: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Layer-output ids, validated: each must be a layer whose output feeds another layer (0 <= i < N-1)."""
    ids = tuple(int(i) for i in layer_ids)
    bad = [i for i in ids if not 0 <= i < num_layers - 1]
    if bad or not ids:
        raise ValueError(f"feature layers {list(ids)} must be layer-output ids in [0, {num_layers - 1}) "
                         f"(the last layer's output is normed before the head)")
    return ids


def builder_layers(layer_ids: Sequence[int]) -> list[int]:
    """onnxruntime-genai's aux_hidden_state_layers for layer-output ids: the layer each output enters."""
    return [int(i) + 1 for i in layer_ids]


def hf_hidden_state_index(layer_id: int) -> int:
    """Index into transformers' `output_hidden_states` tuple of layer-output id `layer_id`."""
    return int(layer_id) + 1
