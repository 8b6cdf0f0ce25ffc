"""Logits only where they are read: a graph input that picks the positions the LM head runs on.

onnxruntime-genai's builder runs the LM head on every new token of a call. A prompt's call needs the logits of its
last position only (the first answer token), yet the head's [hidden, vocab] MatMul runs on all of them: 19-20% of
a 32-, 64- or 128-token prefill of SmolLM2-135M int8-wo (ONNX Runtime's profiler, 1 thread; docs/benchmarks.md).
The builder's own `prune_lm_head` option does this only for its paged-attention graphs (`logits_indices`,
onnxruntime_genai/models/builders/base.py, 0.18.0: `prunes_hidden_rows` requires `use_paged_attention`), not for
the GroupQueryAttention graph specpipe runs.

So specpipe edits the graph it gets: a new input `logits_index` int64 [batch, m], the positions (0-based, within
each row's new tokens) whose logits the call outputs, and a GatherND (batch_dims=1) in front of the LM head's
MatMul: `logits` becomes [batch, m, vocab]. Decode and verify calls pass every position; a prompt's call passes its
last one (each row its own, under right padding). Nothing else in the graph changes (the final norm still runs on
every position: 576 floats a token). Engines exported before this input existed keep working: the engine slices
their logits after the call (engines/shared_kv.py).
"""

from __future__ import annotations

import os
from pathlib import Path

LOGITS_INDEX = "logits_index"  # graph input: int64 [batch, m]
_HEAD_OPS = {"MatMul", "MatMulNBits", "Gemm"}
_PASS_THROUGH = {"Cast", "Identity"}


def add_logits_index(model_path: Path) -> None:
    """Add the `logits_index` input to the graph in `model_path` (external weight data untouched), in place and
    atomically. A graph that has it already is left as it is. Raises ValueError when no LM head feeds `logits`."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    import numpy as np

    model_path = Path(model_path)
    model = onnx.load(str(model_path), load_external_data=False)
    graph = model.graph
    if any(i.name == LOGITS_INDEX for i in graph.input):
        return
    producer = {out: node for node in graph.node for out in node.output}
    head = producer.get("logits")
    while head is not None and head.op_type in _PASS_THROUGH:
        head = producer.get(head.input[0])
    if head is None or head.op_type not in _HEAD_OPS:
        raise ValueError(f"{model_path}: no MatMul produces 'logits' (found {head.op_type if head else 'nothing'})")
    hidden = head.input[0]
    axes, index3, picked = "logits_index/axes", "logits_index/unsqueezed", "logits_index/hidden"
    graph.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), axes))
    graph.input.append(helper.make_tensor_value_info(LOGITS_INDEX, TensorProto.INT64, ["batch_size", "logits_length"]))
    nodes = [helper.make_node("Unsqueeze", [LOGITS_INDEX, axes], [index3], name="/logits_index/Unsqueeze"),
             helper.make_node("GatherND", [hidden, index3], [picked], name="/logits_index/GatherND", batch_dims=1)]
    head.input[0] = picked
    # Topological order: the new nodes go right before the head.
    position = list(graph.node).index(head)
    for offset, node in enumerate(nodes):
        graph.node.insert(position + offset, node)
    for output in graph.output:
        if output.name == "logits":
            output.type.tensor_type.shape.dim[1].dim_param = "logits_length"
    tmp = model_path.with_name(model_path.name + ".tmp")
    onnx.save_model(model, str(tmp))
    os.replace(tmp, model_path)


def has_logits_index(session) -> bool:
    """Whether an onnxruntime session's graph takes `logits_index`."""
    return any(i.name == LOGITS_INDEX for i in session.get_inputs())
