"""ONNX graph plumbing for quantization: load and save engine graphs, and untie a shared lm_head.

Graphs are the ones optimum exports for `text-generation-with-past`. Quantizers only touch MatMuls whose
weight is a constant initializer; `untie_lm_head` makes sure the head is one of them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specpipe.config import THREADS

MODEL_FILE = "model.onnx"
EXTERNAL_DATA_FILE = MODEL_FILE + ".data"
PROTOBUF_LIMIT = 1_800_000_000  # protobuf refuses messages over 2 GB; keep a margin


def load_model(folder: Path):
    """The graph in `folder`, with its external weights (if any) loaded into memory.

    onnx refuses external data in a file with several hard links ("potential hardlink attack"), and a build
    hard-links one engine into several places (a self-draft, the Triton repository): such a file is read
    through a private copy."""
    import shutil
    import tempfile

    import onnx

    folder = Path(folder)
    data = folder / EXTERNAL_DATA_FILE
    if not data.is_file() or data.stat().st_nlink == 1:
        return onnx.load(str(folder / MODEL_FILE), load_external_data=True)
    with tempfile.TemporaryDirectory(prefix="specpipe-onnx-", dir=folder.parent) as tmp:
        shutil.copy2(folder / MODEL_FILE, Path(tmp) / MODEL_FILE)
        shutil.copyfile(data, Path(tmp) / EXTERNAL_DATA_FILE)
        return onnx.load(str(Path(tmp) / MODEL_FILE), load_external_data=True)


def save_model(model, folder: Path) -> list[Path]:
    """Write `model` as folder/model.onnx, weights in model.onnx.data when the graph is too big for one file."""
    import onnx

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    external = model.ByteSize() > PROTOBUF_LIMIT
    onnx.save_model(
        model,
        str(folder / MODEL_FILE),
        save_as_external_data=external,
        all_tensors_to_one_file=True,
        location=EXTERNAL_DATA_FILE,
        size_threshold=1024,
    )
    return model_files(folder)


def model_files(folder: Path) -> list[Path]:
    folder = Path(folder)
    return [p for p in (folder / MODEL_FILE, folder / EXTERNAL_DATA_FILE) if p.is_file()]


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in model_files(folder))


def constant_weight_matmuls(model) -> list[str]:
    """Names of MatMul nodes whose second input is an initializer: the linear layers (q/k/v/o, MLP, head)."""
    initializers = {init.name for init in model.graph.initializer}
    return [node.name for node in model.graph.node if node.op_type == "MatMul" and node.input[1] in initializers]


def lm_head_matmul(model) -> str | None:
    """Name of the MatMul that writes the graph's `logits` output (the lm_head), if there is one."""
    return next((node.name for node in model.graph.node if node.op_type == "MatMul" and "logits" in node.output), None)


def untie_lm_head(model) -> list[str]:
    """Give every MatMul that reads a transposed initializer its own constant weight. Returns their names.

    With tied embeddings (SmolLM2 and most small LMs) optimum exports the head as
    MatMul(hidden, Transpose(embed_tokens.weight)): the weight is computed, so weight-only quantizers
    skip it ("MatMul doesn't have const weight") and a 113 MB fp32 head stays in a 4-bit model. Folding
    the Transpose into a new initializer costs one extra copy of the matrix in the fp32 graph, but
    lets the head be quantized with the rest; the embedding Gather keeps reading the original.
    """
    from onnx import numpy_helper

    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            consumers[name] = consumers.get(name, 0) + 1

    untied, dead = [], []
    for node in graph.node:
        if node.op_type != "MatMul" or node.input[1] in initializers:
            continue
        transpose = producers.get(node.input[1])
        if transpose is None or transpose.op_type != "Transpose" or transpose.input[0] not in initializers:
            continue
        perm = next((list(a.ints) for a in transpose.attribute if a.name == "perm"), None)
        source = numpy_helper.to_array(initializers[transpose.input[0]])
        weight = np.ascontiguousarray(np.transpose(source, perm))  # perm None = reverse axes, as ONNX says
        weight_name = f"{node.name.strip('/').replace('/', '.')}.weight_untied"
        graph.initializer.append(numpy_helper.from_array(weight, weight_name))
        initializers[weight_name] = graph.initializer[-1]
        node.input[1] = weight_name
        untied.append(node.name)
        consumers[transpose.output[0]] -= 1
        if consumers[transpose.output[0]] == 0:
            dead.append(transpose)
    for transpose in dead:
        graph.node.remove(transpose)
    return untied


def slice_lm_head(model, token_ids: np.ndarray) -> str:
    """Keep only the lm_head columns of `token_ids` (in that order): `logits` becomes [batch, n, len(ids)].

    A draft's head is most of its cost (SmolLM2: a 49152 x 576 matrix against 3.5M weights per layer),
    and its training data uses a few thousand distinct tokens; scoring only those is FR-Spec's
    frequency-ranked draft vocabulary (Zhao et al. 2025). The embedding Gather keeps the whole vocabulary,
    so any token can still be fed. Returns the head MatMul's name.
    """
    from onnx import numpy_helper

    untie_lm_head(model)
    head = lm_head_matmul(model)
    initializers = {init.name: init for init in model.graph.initializer}
    node = next((n for n in model.graph.node if n.name == head), None)
    if node is None or node.input[1] not in initializers:
        raise ValueError("the graph has no lm_head MatMul with a constant weight writing `logits`")
    init = initializers[node.input[1]]
    weight = numpy_helper.to_array(init)  # [hidden, vocab]
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.ndim != 1 or not len(ids) or ids.min() < 0 or ids.max() >= weight.shape[1]:
        raise ValueError(f"token ids must be a non-empty list within the head's {weight.shape[1]} columns")
    sliced = numpy_helper.from_array(np.ascontiguousarray(weight[:, ids]), init.name)
    if sum(name == init.name for n in model.graph.node for name in n.input) > 1:
        # Another node reads the same matrix: onnxruntime-genai's builder ties the embedding to the head's
        # initializer (a Transpose + Gather). The head gets a sliced copy of its own; the embedding keeps it whole.
        sliced.name = f"{init.name}_sliced"
        model.graph.initializer.append(sliced)
        node.input[1] = sliced.name
    else:
        init.CopyFrom(sliced)
    for value in [*model.graph.output, *model.graph.value_info]:
        if value.name == "logits":
            vocab_dim = value.type.tensor_type.shape.dim[-1]
            vocab_dim.ClearField("dim_param")
            vocab_dim.dim_value = len(ids)
    return head


def kv_input_shapes(model) -> dict[str, tuple[int, int]]:
    """{past_key_values.i.key|value: (num_kv_heads, head_dim)} read from the graph's input declarations."""
    shapes = {}
    for graph_input in model.graph.input:
        if graph_input.name.startswith("past_key_values."):
            dims = graph_input.type.tensor_type.shape.dim  # [batch, kv_heads, past_len, head_dim]
            shapes[graph_input.name] = (int(dims[1].dim_value), int(dims[3].dim_value))
    return shapes


def save_ort_optimized(
    folder: Path, *, threads: int = THREADS, disabled_optimizers: tuple[str, ...] = (), config: dict[str, str] | None = None
) -> None:
    """Replace folder/model.onnx with ONNX Runtime's optimized graph (as the build does for fp32 engines).

    Done here, once, because the optimizer is also where QDQ pairs become integer kernels; the quantizer
    says which optimizers to hold back (see static.ORT_OPTIMIZER_SETTINGS for why).
    """
    import tempfile

    import onnxruntime as ort

    from specpipe.engines.onnxruntime import session_options

    folder = Path(folder)
    with tempfile.TemporaryDirectory(prefix="specpipe-opt-", dir=folder) as tmp:
        options = session_options(threads)
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED  # the highest that saves
        options.optimized_model_filepath = str(Path(tmp) / MODEL_FILE)
        for key, value in (config or {}).items():
            options.add_session_config_entry(key, value)
        if folder_bytes(folder) > PROTOBUF_LIMIT:
            options.add_session_config_entry("session.optimized_model_external_initializers_file_name", EXTERNAL_DATA_FILE)
            options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        ort.InferenceSession(
            str(folder / MODEL_FILE), options, providers=["CPUExecutionProvider"], disabled_optimizers=list(disabled_optimizers)
        )
        for path in model_files(folder):
            path.unlink()
        for path in model_files(Path(tmp)):
            path.rename(folder / path.name)
