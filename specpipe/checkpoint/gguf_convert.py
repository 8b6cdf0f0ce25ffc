"""Convert a GGUF file, once, into a normal Hugging Face checkpoint (float32 safetensors + tokenizer).

transformers does the heavy lifting (`from_pretrained(..., gguf_file=...)` dequantizes the weights
and rebuilds a fast tokenizer). Its tokenizer rebuild (4.57) loses facts the GGUF states plainly,
so we put them back from the file's own metadata, never from guesses:

- special tokens: for Llama-architecture GGUFs it sets both BOS and EOS to the BOS token
  (SmolLM2: EOS became <|im_start|> instead of <|im_end|>) and drops the padding token;
- BOS insertion: it always prepends BOS, even when the GGUF says `add_bos_token = false`;
- pre-tokenization: for byte-level BPE vocabularies it ignores `tokenizer.ggml.pre`, so digits
  merge where the original split them one by one (llama.cpp's table, see _BYTE_LEVEL_PRE_SPLITS);
- decoding: byte-level vocabularies get SentencePiece decoder steps that can eat a leading space.

Each repair is written to `specpipe-source.json` in the converted folder, with the GGUF's hash.
A GGUF without a padding token stays without one (recorded there too).
"""

from __future__ import annotations

import json
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from specpipe.checkpoint.cache import atomic_dir, cache_dir, sha256_file
from specpipe.checkpoint.load import first_line
from specpipe.errors import CheckpointError

SOURCE_RECORD = "specpipe-source.json"
# Part of the cache key: bump it when a change here alters the converted output, so caches re-convert.
CONVERTER_VERSION = 1

# The split regex behind each llama.cpp pre-tokenizer name for byte-level BPE vocabularies
# (llama.cpp src/llama-vocab.cpp, llm_tokenizer_bpe: STARCODER/REFACT/COMMAND_R/SMOLLM/CODESHELL/EXAONE
# share "\p{N}" + the GPT-2 regex; GPT2/MPT/OLMO use the GPT-2 regex alone; LLAMA3 its own).
# tokenizers' ByteLevel(use_regex=True) applies the GPT-2 regex itself.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGITS_THEN_GPT2 = ("digits", "gpt2")
_BYTE_LEVEL_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    **{name: _DIGITS_THEN_GPT2 for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")},
    **{name: ("gpt2",) for name in ("gpt-2", "gpt2", "mpt", "olmo", "default")},
    "llama-bpe": ("llama3",),
}


_GGUF_ID_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "pad": "padding_token_id"}


@dataclass
class GGUFTokenizerMeta:
    """What the GGUF says about its tokenizer (None = the file does not say)."""

    model: Optional[str]
    pre: Optional[str]
    bos_id: Optional[int]
    eos_id: Optional[int]
    unk_id: Optional[int]
    pad_id: Optional[int]
    add_bos: Optional[bool]
    add_eos: Optional[bool]
    chat_template: Optional[str]
    architecture: str
    context_length: Optional[int]
    file_type: Optional[int]


def read_gguf_meta(gguf_path: Path) -> GGUFTokenizerMeta:
    import gguf

    try:
        fields = gguf.GGUFReader(str(gguf_path)).fields
    except Exception as err:  # the reader raises ValueError/struct errors on a corrupt file
        raise CheckpointError(f"{gguf_path} is not a readable GGUF file: {first_line(err)}") from err

    def get(key: str) -> Any:
        field = fields.get(key)
        return None if field is None else field.contents()

    arch = get("general.architecture")
    if not arch:
        raise CheckpointError(f"{gguf_path} is not a model GGUF (no general.architecture)")
    return GGUFTokenizerMeta(
        model=get("tokenizer.ggml.model"),
        pre=get("tokenizer.ggml.pre"),
        bos_id=get("tokenizer.ggml.bos_token_id"),
        eos_id=get("tokenizer.ggml.eos_token_id"),
        unk_id=get("tokenizer.ggml.unknown_token_id"),
        pad_id=get("tokenizer.ggml.padding_token_id"),
        add_bos=get("tokenizer.ggml.add_bos_token"),
        add_eos=get("tokenizer.ggml.add_eos_token"),
        chat_template=get("tokenizer.chat_template"),
        architecture=arch,
        context_length=get(f"{arch}.context_length"),
        file_type=get("general.file_type"),
    )


def converted_dir_for(gguf_sha256: str) -> Path:
    return cache_dir() / "gguf" / f"{gguf_sha256[:20]}-v{CONVERTER_VERSION}"


def convert_gguf(gguf_path: Path) -> Path:
    """The HF checkpoint folder for `gguf_path`, converting it on first use (keyed by the file's sha256)."""
    gguf_path = Path(gguf_path).resolve()
    gguf_sha256 = sha256_file(gguf_path)
    final = converted_dir_for(gguf_sha256)
    if (final / "config.json").is_file():
        return final
    started = time.perf_counter()
    with parsed_once(), atomic_dir(final) as out:
        meta = read_gguf_meta(gguf_path)
        repairs = _convert_into(gguf_path, meta, out)
        record = {
            "format": 1,
            "kind": "gguf",
            "converter_version": CONVERTER_VERSION,
            "gguf_file": gguf_path.name,
            "gguf_sha256": gguf_sha256,
            "gguf_architecture": meta.architecture,
            "gguf_file_type": meta.file_type,
            "dtype": "float32 (dequantized)",
            "tokenizer_repairs": repairs,
            "pad_token": "from tokenizer.ggml.padding_token_id" if meta.pad_id is not None else None,
            "versions": _versions(),
            "seconds": round(time.perf_counter() - started, 1),
        }
        (out / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return final


@contextmanager
def parsed_once():
    """Within it, each GGUF file is parsed once. transformers parses the file afresh for the config, the tokenizer
    and the weights (`load_gguf_checkpoint`, which imports `gguf.GGUFReader` at each call), and gguf's reader
    builds every metadata field in Python: SmolLM2-135M's 49k-token vocabulary took ~5.6 s a parse on the AVX2 Zen 3
    here, five parses in a conversion. The reader is read-only once built (fields, and tensors as views of the
    memory-mapped file), so one serves them all."""
    import gguf

    original = gguf.GGUFReader
    readers: dict = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def read_source_record(folder: Path) -> Optional[dict]:
    path = Path(folder) / SOURCE_RECORD
    return json.loads(path.read_text()) if path.is_file() else None


def _convert_into(gguf_path: Path, meta: GGUFTokenizerMeta, out: Path) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Load from a folder holding only a link to the GGUF: files that happen to sit next to the
    # GGUF (a config.json, a tokenizer.json) must not leak into the conversion.
    staging = out / ".gguf-staging"
    staging.mkdir()
    (staging / gguf_path.name).symlink_to(gguf_path)
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the GGUF loader warns about Llama "legacy" mode on every load
    try:
        tokenizer = AutoTokenizer.from_pretrained(staging, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(staging, gguf_file=gguf_path.name, dtype=torch.float32)
    except (ValueError, KeyError, OSError, RuntimeError) as err:
        raise CheckpointError(f"cannot convert {gguf_path.name}: transformers could not load it ({first_line(err)})") from err
    finally:
        quiet.setLevel(level)
        (staging / gguf_path.name).unlink()
        staging.rmdir()

    tokenizer, repairs = repair_tokenizer(tokenizer, meta)
    for config in (model.config, model.generation_config):
        config.bos_token_id = meta.bos_id
        config.eos_token_id = meta.eos_id
        config.pad_token_id = meta.pad_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return repairs


def repair_tokenizer(tokenizer, meta: GGUFTokenizerMeta):
    """Rebuild the HF tokenizer with the GGUF's own special tokens, BOS rule and pre-tokenizer.

    Returns (PreTrainedTokenizerFast, list of repairs made, in words).
    """
    from tokenizers import decoders, processors
    from transformers import PreTrainedTokenizerFast

    backend = tokenizer.backend_tokenizer
    repairs: list[str] = []

    def token(token_id: Optional[int]) -> Optional[str]:
        return None if token_id is None else backend.id_to_token(token_id)

    special = {"bos": token(meta.bos_id), "eos": token(meta.eos_id), "unk": token(meta.unk_id), "pad": token(meta.pad_id)}
    for name, value in special.items():
        before = getattr(tokenizer, f"{name}_token")
        if before != value:
            repairs.append(f"{name}_token {before!r} -> {value!r} (from tokenizer.ggml.{_GGUF_ID_KEYS[name]})")

    if meta.model == "gpt2":  # byte-level BPE
        # transformers decodes Llama-architecture GGUFs with SentencePiece steps; one of them strips
        # a leading space (when add_space_prefix is unset), so "  x" came back as " x".
        if type(backend.decoder) is not decoders.ByteLevel:
            repairs.append(f"decoder {type(backend.decoder).__name__} -> ByteLevel (byte-level BPE vocabulary)")
            backend.decoder = decoders.ByteLevel()
        splits = _BYTE_LEVEL_PRE_SPLITS.get(meta.pre or "default")
        if splits is None:
            repairs.append(
                f"pre-tokenizer {meta.pre!r} is not in specpipe's table: kept transformers' GPT-2 split"
                " (text with digits may tokenize differently from the original)"
            )
        else:
            backend.pre_tokenizer = _byte_level_pre_tokenizer(splits)
            repairs.append(f"pre-tokenizer set from tokenizer.ggml.pre={meta.pre!r}: {' then '.join(splits)} split")

    if meta.add_bos is not None or meta.add_eos is not None:
        single, pairs, used = "$A", "$A $B:1", []
        if meta.add_bos and special["bos"] is not None:
            single, pairs = f"{special['bos']} {single}", f"{special['bos']} $A {special['bos']}:1 $B:1"
            used.append((special["bos"], meta.bos_id))
        if meta.add_eos and special["eos"] is not None:
            single, pairs = f"{single} {special['eos']}", f"{pairs} {special['eos']}:1"
            used.append((special["eos"], meta.eos_id))
        backend.post_processor = processors.TemplateProcessing(single=single, pair=pairs, special_tokens=used)
        repairs.append(
            f"encode adds {'BOS' if meta.add_bos else 'no BOS'} and {'EOS' if meta.add_eos else 'no EOS'}"
            f" (tokenizer.ggml.add_bos_token={meta.add_bos}, add_eos_token={meta.add_eos})"
        )

    repaired = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=special["bos"],
        eos_token=special["eos"],
        unk_token=special["unk"],
        pad_token=special["pad"],
        chat_template=meta.chat_template,
        # The original tokenizers keep spaces before punctuation; cleaning them up breaks round trips.
        clean_up_tokenization_spaces=False,
        model_max_length=meta.context_length or tokenizer.model_max_length,
    )
    return repaired, repairs


def _byte_level_pre_tokenizer(splits: tuple[str, ...]):
    from tokenizers import Regex, pre_tokenizers

    steps = []
    for split in splits:
        if split == "digits":
            steps.append(pre_tokenizers.Digits(individual_digits=True))
        elif split == "llama3":
            steps.append(pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated", invert=False))
    # ByteLevel's own regex *is* the GPT-2 one; after a custom Split it must not split again.
    gpt2_regex = splits[-1] == "gpt2"
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=gpt2_regex))
    return pre_tokenizers.Sequence(steps)


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("transformers", "gguf", "tokenizers", "torch")}
