"""The llamacpp peer: llama.cpp through llama-cpp-python's `Llama.generate`, on GGUF files.

Models: at fp32 (int8), each checkpoint converted by llama.cpp's own `convert_hf_to_gguf.py --outtype f32`
(`q8_0`), taken from the llama-cpp-python sdist of the installed version (pip download, cached), so the
weights are the ones specpipe runs; a checkpoint that specpipe itself converted from an f32 GGUF runs
that GGUF. At int4 the f32 GGUF is quantized to Q4_0 by llama.cpp's own quantize (`llama_model_quantize`,
its default recipe for the type), which the converter cannot write. When the converter cannot take a checkpoint (an unknown BPE pre-tokenizer), the GGUF the
checkpoint came from runs instead, at its own precision, and a note says so.

Rows: target alone; prompt lookup (`LlamaPromptLookupDecoding`, the binding's own drafter); and the
draft model at a fixed K through the binding's drafter interface (`LlamaDraftModel`), filled by a
second `Llama` on the draft GGUF drafting greedily: llama-cpp-python ships the interface but no
draft-model drafter of its own. llama.cpp reports no acceptance counts here.

A crash of llama.cpp's own kernels would end the whole bench (a signal, not an exception), so each GGUF is first
run in a child process (`runnable`): load it, evaluate a few tokens. If the child dies, llama.cpp is tried again
without its extra buffer types (`use_extra_bufts`, llama.h: the repacked weights its AMX and other repacking
kernels run on) and, if that runs, every `Llama` on that GGUF is made so, with a note; if neither runs, the peer is
skipped with a note. On an Intel Emerald Rapids (AMX) with llama-cpp-python 0.3.36 built for the machine, Q8_0
through the AMX buffers died with SIGILL on its first `tilezero`/`tileloadd` (2026-11-30), with or without AMX
permission asked of the kernel (arch_prctl ARCH_REQ_XCOMP_PERM), while a small C program's tiles ran once it had it.
Upstream has the same report from a virtualized guest (ggml-org/llama.cpp#28756, open: SIGILL on the AMX path of a
CPU that reports AMX_INT8) and ggml's "AMX is not ready to be used!" before an illegal instruction (#13678).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tarfile
import time
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Optional

from specpipe.bench.harness import Measurement
from specpipe.bench.peers.common import PeerPair, PeerRow, cached_conversion, package_version, run_tool
from specpipe.errors import ExportError

N_CTX = 2048  # prompts + 128 new tokens + a draft fit; a smaller KV cache than the model's 8192 costs nothing here
# llama-cpp-python's own defaults for its prompt-lookup drafter.
PROMPT_LOOKUP = {"max_ngram_size": 2, "num_pred_tokens": 10}
OUTTYPE = {"fp32": "f32", "int8": "q8_0"}  # convert_hf_to_gguf.py --outtype per precision
QUANTIZE_FTYPE = {"int4": "LLAMA_FTYPE_MOSTLY_Q4_0"}  # precisions llama.cpp's quantize makes from the f32 GGUF
GGUF_TYPE = {"fp32": "f32", "int8": "q8_0", "int4": "q4_0"}  # how the rows and notes name each
GGUF_F32 = 0  # gguf's LlamaFileType.ALL_F32


def converter_dir() -> Path:
    """llama.cpp's convert_hf_to_gguf.py with its `conversion` and `gguf-py` packages, from the sdist of the
    installed llama-cpp-python (its wheel ships the binding only), cached."""
    from specpipe.checkpoint.cache import atomic_dir, cache_dir

    version = package_version("llama-cpp-python")
    final = cache_dir() / "peers" / "llamacpp-convert" / version
    if (final / "convert_hf_to_gguf.py").is_file():
        return final
    with atomic_dir(final) as tmp:
        run_tool(["-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
                  "-d", str(tmp / "sdist"), f"llama-cpp-python=={version}"],
                 f"pip download of the llama-cpp-python {version} sdist (for llama.cpp's convert_hf_to_gguf.py)")
        archives = sorted((tmp / "sdist").glob("llama_cpp_python-*.tar.gz"))
        if not archives:
            raise ExportError(f"pip downloaded no llama-cpp-python {version} sdist")
        with tarfile.open(archives[0]) as archive:
            wanted = ("vendor/llama.cpp/convert_hf_to_gguf.py", "vendor/llama.cpp/conversion/", "vendor/llama.cpp/gguf-py/")
            for member in archive.getmembers():
                inner = member.name.split("/", 1)[-1]
                if (member.isfile() and any(inner == w or (w.endswith("/") and inner.startswith(w)) for w in wanted)):
                    member.name = inner[len("vendor/llama.cpp/"):]
                    archive.extract(member, tmp, filter="data")
        for path in (tmp / "sdist",):
            for item in path.iterdir():
                item.unlink()
            path.rmdir()
    return final


def gguf_for(checkpoint_dir: Path, source_gguf: Optional[Path], precision: str) -> tuple[Path, Optional[str]]:
    """A GGUF of the checkpoint at `precision`, and a note when it had to be another precision."""
    if source_gguf is not None and _file_type(source_gguf) == GGUF_F32 and precision == "fp32":
        return source_gguf, None
    if precision in OUTTYPE or precision in QUANTIZE_FTYPE:
        try:
            return (_converted(checkpoint_dir, precision) if precision in OUTTYPE
                    else _quantized(checkpoint_dir, source_gguf, precision)), None
        except ExportError as err:
            if source_gguf is None:
                raise
            why = str(err)
    else:
        why = f"llama.cpp's converter writes no {precision}"
        if source_gguf is None:
            raise ExportError(f"{why}, and {checkpoint_dir} came from no GGUF")
    return source_gguf, f"runs {source_gguf.name} (its own precision), not {precision}: {why}"


def _converted(checkpoint_dir: Path, precision: str) -> Path:
    tools = converter_dir()
    tool = f"llama.cpp convert_hf_to_gguf.py of llama-cpp-python {package_version('llama-cpp-python')}"

    def convert(out: Path) -> None:
        import os

        env_path = os.pathsep.join([str(tools / "gguf-py"), str(tools)])
        run_tool(["-c", "import sys, runpy; sys.path[:0] = sys.argv[1].split(sys.argv[2]); sys.argv = sys.argv[3:]; "
                  "runpy.run_path(sys.argv[0], run_name='__main__')", env_path, os.pathsep,
                  str(tools / "convert_hf_to_gguf.py"), str(checkpoint_dir), "--outtype", OUTTYPE[precision],
                  "--outfile", str(out / "model.gguf")],
                 f"llama.cpp's convert_hf_to_gguf.py on {checkpoint_dir}")

    return cached_conversion("llamacpp", checkpoint_dir, precision, tool, convert) / "model.gguf"


def _quantized(checkpoint_dir: Path, source_gguf: Optional[Path], precision: str) -> Path:
    """The f32 GGUF (as the fp32 rows run it) quantized by llama.cpp's `llama_model_quantize`, cached. It runs in a
    subprocess, as the converter does: llama.cpp prints a line per tensor, and a failure becomes one line."""
    f32, _ = gguf_for(checkpoint_dir, source_gguf, "fp32")
    ftype = QUANTIZE_FTYPE[precision]
    tool = f"llama.cpp llama_model_quantize {ftype} of llama-cpp-python {package_version('llama-cpp-python')}"

    def quantize(out: Path) -> None:
        run_tool(["-c", "import ctypes, sys, llama_cpp; params = llama_cpp.llama_model_quantize_default_params(); "
                  "params.ftype = getattr(llama_cpp, sys.argv[3]); "
                  "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))",
                  str(f32), str(out / "model.gguf"), ftype], f"{tool} on {f32}")

    return cached_conversion("llamacpp", f32, precision, tool, quantize) / "model.gguf"


def _file_type(path: Path) -> Optional[int]:
    try:
        import gguf

        field = gguf.GGUFReader(str(path)).fields.get("general.file_type")
        return int(field.parts[field.data[0]][0]) if field is not None else None
    except Exception:
        return None


# Run in a child: load a GGUF as `load` does, with or without extra buffer types, and evaluate a few tokens.
_PROBE = """
import sys
from specpipe.bench.peers.llamacpp import _llama
llm = _llama(sys.argv[1], extra_buffers=sys.argv[2] == "1", n_ctx=64, n_threads=int(sys.argv[3]),
             n_threads_batch=int(sys.argv[3]), verbose=False)
llm.eval([1, 2, 3, 4])
llm.eval([5])
"""
PROBE_TIMEOUT_S = 300


def _died(gguf: Path, threads: int, extra_buffers: bool) -> Optional[str]:
    """None if the probe ran; else how the child ended (a signal's name, or its exit code and last line)."""
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, str(gguf), "1" if extra_buffers else "0", str(threads)],
                              capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"no answer in {PROBE_TIMEOUT_S} s"
    if done.returncode == 0:
        return None
    if done.returncode < 0:
        return signal.Signals(-done.returncode).name
    return f"exit {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1]}"


@lru_cache(maxsize=None)
def runnable(gguf: Path, threads: int) -> tuple[bool, Optional[str]]:
    """(extra buffer types on, note) for a GGUF llama.cpp runs here (module docstring); ExportError if it runs in
    neither way."""
    died = _died(gguf, threads, extra_buffers=True)
    if died is None:
        return True, None
    died_plain = _died(gguf, threads, extra_buffers=False)
    if died_plain is None:
        return False, (f"llama.cpp died ({died}) running {gguf.parent.name}/{gguf.name} on its repacked CPU buffers "
                       f"(AMX, repack) in a probe: its rows here run without them (use_extra_bufts off)")
    raise ExportError(f"llama.cpp died running {gguf.name} on this CPU ({died}; without extra buffer types: "
                      f"{died_plain})")


@contextmanager
def _model_params(extra_buffers: bool):
    """llama-cpp-python's `Llama` (0.3.x) takes no argument for llama.h's `use_extra_bufts`; it starts from
    `llama_model_default_params()`, so that is what is changed, for the one constructor call."""
    import llama_cpp.llama_cpp as lib

    if extra_buffers:
        yield
        return
    default = lib.llama_model_default_params

    def without_extra_buffers():
        params = default()
        params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = without_extra_buffers
    try:
        yield
    finally:
        lib.llama_model_default_params = default


def _llama(model_path: str, *, extra_buffers: bool = True, **kwargs):
    from llama_cpp import Llama

    with _model_params(extra_buffers):
        return Llama(model_path=str(model_path), **kwargs)


def load(gguf: Path, threads: int, draft_model=None):
    # With a draft model llama-cpp-python keeps every position's logits (llama.py 0.3.36: `_logits_all = logits_all if
    # draft_model is None else True`) but sizes its `scores` array by the logits_all argument (n_batch rows when
    # False), so a prompt longer than n_batch (512) raised a ValueError in eval. Asking for logits_all with a draft
    # model sizes the array for the context (n_ctx rows), as the eval writes it.
    extra_buffers, _ = runnable(gguf, threads)
    return _llama(gguf, extra_buffers=extra_buffers, n_ctx=N_CTX, n_threads=threads, n_threads_batch=threads,
                  verbose=False, draft_model=draft_model, logits_all=draft_model is not None)


class LlamaGenerate:
    def __init__(self, llm, eos_token_ids: list[int], drafter=None, k: Optional[int] = None):
        self.llm, self.eos_token_ids, self.drafter, self.k = llm, eos_token_ids, drafter, k

    def __call__(self, prompt_ids: list[int], max_new_tokens: int) -> Measurement:
        if self.drafter is not None:
            self.drafter.k = self.k  # the K rows share one target Llama and one drafter
            self.drafter.llm.reset()
        # No KV reuse across prompts (generate() would keep the shared chat-template prefix): the other engines'
        # rows prefill every prompt from scratch, and so TTFT compares like with like.
        self.llm.reset()
        ids: list[int] = []
        start = time.perf_counter()
        first_token_at = None
        # temp 0: llama.cpp's greedy sampler; no repetition penalty, so the argmax alone decides.
        for token in self.llm.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                       reset=True):
            first_token_at = first_token_at or time.perf_counter()
            ids.append(int(token))
            if token in self.eos_token_ids or len(ids) >= max_new_tokens:
                break
        total_ms = (time.perf_counter() - start) * 1e3
        ttft_ms = ((first_token_at or time.perf_counter()) - start) * 1e3
        return Measurement(prompt_id="", num_generated=len(ids), total_ms=total_ms, ttft_ms=ttft_ms, token_ids=ids)


def draft_model_drafter(draft_llm):
    """llama-cpp-python's `LlamaDraftModel` interface over a second Llama: `k` greedy draft tokens per call.

    The draft Llama keeps its KV cache across calls: `generate(reset=True)` reuses the longest common
    prefix of its evaluated tokens, so each call evaluates only the tokens the target accepted since."""
    import numpy as np
    from llama_cpp.llama_speculative import LlamaDraftModel

    class DraftLlama(LlamaDraftModel):
        k = 1
        llm = draft_llm

        def __call__(self, input_ids, /, **kwargs):
            drafted = []
            for token in draft_llm.generate(list(map(int, input_ids)), temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                            repeat_penalty=1.0, reset=True):
                drafted.append(int(token))
                if len(drafted) >= self.k:
                    break
            return np.array(drafted, dtype=np.intc)

    return DraftLlama()


def accuracy(pair: PeerPair, token_batches) -> tuple[object, str]:
    """The target GGUF at the pair's precision against the f32 GGUF, by specpipe's accuracy check (teacher-forced
    logits of every position, `logits_all`). Returns (AccuracyReport, the quantized model's name)."""
    from specpipe.quantize.accuracy import compare_models

    reference, _ = gguf_for(pair.target_dir, pair.target_gguf, "fp32")
    quantized, note = gguf_for(pair.target_dir, pair.target_gguf, pair.precision)
    name = quantized.name if note else GGUF_TYPE.get(pair.precision, pair.precision)
    return compare_models(_all_logits(reference, pair.threads), _all_logits(quantized, pair.threads), token_batches,
                          mode=name), name


def _all_logits(gguf: Path, threads: int):
    import numpy as np

    extra_buffers, _ = runnable(gguf, threads)
    llm = _llama(gguf, extra_buffers=extra_buffers, n_ctx=N_CTX, n_threads=threads, n_threads_batch=threads,
                 logits_all=True, verbose=False)

    def logits(token_ids: list[int]) -> np.ndarray:  # [len(token_ids), vocab] from an empty cache
        llm.reset()
        llm.eval(token_ids)
        return np.array(llm.scores[: len(token_ids)], dtype=np.float32)

    return logits


def rows(pair: PeerPair) -> tuple[list[PeerRow], list[str]]:
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    eos, notes = list(pair.eos_token_ids), []
    target_gguf, note = gguf_for(pair.target_dir, pair.target_gguf, pair.precision)
    notes += [f"target {note}"] if note else []
    precision = pair.precision if note is None else target_gguf.name
    _, probed = runnable(target_gguf, pair.threads)  # ExportError if llama.cpp cannot run it here: no rows
    notes += [probed] if probed else []
    out = [PeerRow("llamacpp target-only", "llamacpp", "target-only", None, precision,
                   LlamaGenerate(load(target_gguf, pair.threads), eos))]
    if pair.draft_dir is not None:
        try:
            draft_gguf, note = gguf_for(pair.draft_dir, pair.draft_gguf, pair.precision)
            _, probed = runnable(draft_gguf, pair.threads)
        except ExportError as err:
            notes.append(f"draft-model rows skipped: {err}")
        else:
            notes += [f"draft {note}"] if note else []
            notes += [probed] if probed else []
            drafter = draft_model_drafter(load(draft_gguf, pair.threads))
            speculative = load(target_gguf, pair.threads, drafter)
            for k in pair.draft_lengths:
                out.append(PeerRow(f"llamacpp K={k}", "llamacpp", "draft-model", k, precision,
                                   LlamaGenerate(speculative, eos, drafter, k)))
    lookup = load(target_gguf, pair.threads, LlamaPromptLookupDecoding(**PROMPT_LOOKUP))
    out.append(PeerRow("llamacpp prompt-lookup", "llamacpp", "prompt-lookup", None, precision,
                       LlamaGenerate(lookup, eos), PROMPT_LOOKUP))
    return out, notes
