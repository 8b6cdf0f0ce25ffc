"""Load a resolved checkpoint folder safely: float32, eval mode, safetensors, never remote code."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from specpipe.checkpoint.cache import PICKLE_SUFFIXES, weight_files
from specpipe.errors import CheckpointError


def load_config(path: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (ValueError, OSError, KeyError) as err:
        # ValueError is what transformers raises for a model_type it does not know (remote-code models).
        raise CheckpointError(f"cannot read the config of {path}: {first_line(err)}") from err


def causal_lm_architectures() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names: set[str] = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([value] if isinstance(value, str) else value)
    return names


def is_causal_lm(config) -> bool:
    """True when the checkpoint's declared architecture is one transformers loads as a causal LM."""
    architectures = getattr(config, "architectures", None) or []
    if architectures:
        return any(arch in causal_lm_architectures() for arch in architectures)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def architecture_of(config) -> str:
    return (getattr(config, "architectures", None) or [config.model_type])[0]


def require_causal_lm(path: Path, config=None):
    config = config if config is not None else load_config(path)
    if not is_causal_lm(config):
        raise CheckpointError(
            f"{path} is not a causal language model (architecture {architecture_of(config)});"
            " specpipe needs a ...ForCausalLM checkpoint"
        )
    return config


def require_safe_weights(path: Path, *, allow_pickle: bool) -> None:
    files = weight_files(path)
    if not files:
        raise CheckpointError(f"{path} has no weight files (*.safetensors)")
    if not allow_pickle and all(f.suffix in PICKLE_SUFFIXES for f in files):
        raise CheckpointError(
            f"{path} has only pickle weights ({', '.join(f.name for f in files[:3])}), which can run code"
            " when loaded; convert them to safetensors or pass --allow-pickle if you trust the source"
        )
    for file in files:
        if file.suffix == ".safetensors":
            safetensors_header(file)  # whole, or CheckpointError
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{index} is not a safetensors index (no weight_map)") from None
        missing = [shard for shard in shards if not (path / shard).is_file()]
        if missing:
            raise CheckpointError(f"{path} is missing {len(missing)} of the {len(shards)} weight shards its index lists: "
                                  f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")


def safetensors_header(file: Path) -> dict:
    """The header of a safetensors file (tensor name -> dtype, shape, data_offsets), once its size is checked: the
    header says where each tensor's bytes end, so a truncated download (or one with bytes appended) is caught
    without reading the weights. CheckpointError names the sizes."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        prefix = f.read(8)
        header_len = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else None
        if header_len is None or 8 + header_len > size:
            raise CheckpointError(f"{file} is truncated or not safetensors: {size:,} bytes, too short for its own header")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
        ends = [int(tensor["data_offsets"][1]) for name, tensor in header.items() if name != "__metadata__"]
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise CheckpointError(f"{file} is not a safetensors file: its header is not JSON with data_offsets") from None
    expected = 8 + header_len + max(ends, default=0)
    if size < expected:
        raise CheckpointError(f"{file} is truncated: {size:,} of the {expected:,} bytes its header lists "
                              f"({size / expected:.0%}); download it again")
    if size > expected:
        raise CheckpointError(f"{file} is broken: {size:,} bytes where its header lists {expected:,}")
    return header


def load_causal_lm(path: Path, *, allow_pickle: bool = False):
    """The torch model of a checkpoint folder: float32, eval mode, safetensors unless allow_pickle."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    config = require_causal_lm(path)
    require_safe_weights(path, allow_pickle=allow_pickle)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            config=config,
            dtype=torch.float32,
            trust_remote_code=False,
            # None = prefer safetensors, fall back to pickle; True = safetensors or fail.
            use_safetensors=None if allow_pickle else True,
        )
    except (OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"cannot load the model in {path}: {first_line(err)}") from err
    return model.eval()


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"cannot load the tokenizer in {path}: {first_line(err)}") from err


def special_token_ids(tokenizer) -> dict[str, int | None]:
    return {name: getattr(tokenizer, f"{name}_token_id") for name in ("bos", "eos", "pad", "unk")}


def tokenizer_hash(tokenizer) -> str:
    """sha256 over the sorted token->id mapping and the special token ids.

    Two tokenizers with the same hash turn the same ids into the same tokens and agree on
    BOS/EOS/PAD/UNK: what a draft and its target must share.
    """
    payload = {"vocab": sorted(tokenizer.get_vocab().items()), "special": special_token_ids(tokenizer)}
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()).hexdigest()


def first_line(err: BaseException) -> str:
    """An exception as one line: the CLI prints errors on one line."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
