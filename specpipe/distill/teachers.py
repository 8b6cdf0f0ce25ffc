"""Who answers the training prompts: the target in torch (a dtype) or as the ONNX Runtime engine `build` deploys (a
weight precision), chosen by timing each on this machine.

The torch teacher runs the checkpoint through transformers; the ONNX teacher runs the graph build exports (the model
builder's, GroupQueryAttention over a shared KV buffer, engines/shared_kv.py), at the precisions the closing verdict
times (`--verdict-quant`: the ones build will consider), from the same exported folders (verdict.ExportedTargets: one
export per precision per run). Both give the same records (distill/teacher.py); the ONNX one's distributions and
features are the deployed target's own, and on a CPU its int8 weight-only engine decodes a batch several times faster
than torch does (docs/eagle3.md, "the teacher").
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from specpipe.errors import UsageError

# The probe: a small batch answering a few tokens, the teacher's real work (a prefill, then batched decode steps) in
# little time. Rows and lengths are the probe's, not the run's: it ranks the candidates, it does not predict the rate.
PROBE_ROWS = 16
PROBE_PROMPT_TOKENS = 16
PROBE_NEW_TOKENS = 8
# The run-off: candidates whose probe rate is within this share of the best's answer the run's own first batch (its
# rows, its whole prompts, RUNOFF_NEW_TOKENS tokens each), and that decides. The probe's 16 rows cannot tell how a
# row's cost grows up to the batch's 48: on an AVX2-only EPYC it put ONNX int8-wo and fp32 level (84 vs 72, 75 vs 75
# tokens/s) where whole 48-row batches answered 1.25x faster in fp32 (docs/eagle3.md 3o).
RUNOFF_WITHIN = 0.8
RUNOFF_NEW_TOKENS = 16
# The rows a teacher answers at once (`choose_answer_rows`): each candidate answers that many of the run's first
# prompts, whole, with ROWS_NEW_TOKENS tokens each (the ONNX teacher from a KV batch of that many rows). On an Intel
# with AMX (torch bf16, 2 cores) 32-token answers ranked 48 / 96 / 144 rows as 160-token ones did (399 / 497 / 540
# against 375 / 475 / 515 answer tokens/s; docs/eagle3.md 3za). More rows are kept only for at least ROWS_GAIN the
# tokens/s of fewer: they hold more memory (the ONNX teacher's fp32 KV buffer grows with its rows) and a time cap cuts
# a larger batch.
ROWS_NEW_TOKENS = 32
ROWS_GAIN = 1.05
QUANT_NAMES = {"none": "fp32"}  # a build --quant mode as a teacher's name says it


@dataclass(frozen=True)
class Teacher:
    """One candidate: `engine` "torch" with a torch dtype, or "onnx" with a build --quant mode ("none" = fp32)."""

    engine: str
    precision: str

    @property
    def name(self) -> str:
        return f"{self.engine} {QUANT_NAMES.get(self.precision, self.precision)}"

    @classmethod
    def parse(cls, name: str) -> "Teacher":
        engine, precision = name.split(" ", 1)
        if engine == "onnx":
            precision = {v: k for k, v in QUANT_NAMES.items()}.get(precision, precision)
        return cls(engine, precision)

    def cache_key(self) -> dict:
        """What the teacher cache's key says about the teacher. torch keys stay as they were (`dtype`), so torch
        teacher caches made before the ONNX teacher existed stay valid."""
        from specpipe.contract.quant import DEFAULT_GROUP_SIZE, QuantConfig

        if self.engine == "torch":
            return {"dtype": self.precision}
        teacher = {"engine": "onnxruntime", "graph": "model builder, shared KV", "quant": self.precision}
        if self.precision in DEFAULT_GROUP_SIZE:  # the recipe's block size: answers of another recipe are another teacher's
            teacher["block_size"] = QuantConfig(mode=self.precision).block_size
        return {"teacher": teacher}


def teacher_candidates(engine: str, dtype: str, device, quants: Sequence[str], data: Sequence[str]) -> list[Teacher]:
    """The teachers `--teacher-engine` (auto, torch, onnx) and `--teacher-dtype` allow on `device`: torch in the dtype
    asked for or each candidate dtype; ONNX Runtime at each of `quants` (the verdict's precisions), on a CPU only (its
    CPU execution provider) and only for answers (stdlib labels run in torch)."""
    from specpipe.distill.precision import candidates

    onnx_possible = device.type == "cpu" and list(data) == ["answers"]
    if engine == "onnx" and not onnx_possible:
        raise UsageError("--teacher-engine onnx answers prompts on the CPU: it needs --device cpu (or auto without a "
                         "GPU) and --data answers only")
    torch_teachers = [Teacher("torch", d) for d in (candidates(device) if dtype == "auto" else [dtype])]
    onnx_teachers = [Teacher("onnx", q) for q in dict.fromkeys(quants)] if onnx_possible else []
    return {"torch": torch_teachers, "onnx": onnx_teachers, "auto": torch_teachers + onnx_teachers}[engine]


class Teachers:
    """The teachers of one run, each made once when first asked for: torch ones from the loaded model (fp32 on the
    CPU is the model itself, kept exact for initialising the draft; others are copies), ONNX ones as engines loaded
    from `targets` (the run's exported target folders) with a KV batch of `batch_rows` rows."""

    def __init__(self, model, device, *, targets=None, threads: int = 1, batch_rows: int = 48, top_k: int = 32,
                 feature_layers: Sequence[int] = ()):
        self.model, self.device, self.targets, self.threads = model, device, targets, threads
        self.batch_rows, self.top_k, self.feature_layers = batch_rows, top_k, tuple(feature_layers)
        self.made: dict = {}
        self.lent_attention: Optional[str] = None  # the run's model's attention while it is the fp32 teacher

    def torch_model(self, dtype: str):
        import torch

        from specpipe.distill.grouped_attention import use_grouped_attention

        key = ("torch", dtype)
        if key not in self.made:
            # Batched answers are left-padded, so attention runs with a mask; in bf16 on CPU torch's SDPA then takes a
            # slow path (batch 48, 200-token context: 251 ms/step vs 161 ms eager; fp32: equal), and both SDPA and
            # eager copy each key/value head per query head there: grouped attention reads them in place (a 48-row
            # teacher 1.5x in bf16 and fp32, 160-token answers on an Intel with AMX; docs/eagle3.md 3w).
            if dtype == "float32" and self.device.type == "cpu":
                teacher = self.model  # lent: release() gives it back its own attention
                own = teacher.config._attn_implementation
                if use_grouped_attention(teacher):
                    self.lent_attention = own
            else:
                teacher = copy.deepcopy(self.model).to(device=self.device, dtype=getattr(torch, dtype))
                if not use_grouped_attention(teacher):
                    teacher.set_attn_implementation("eager")
            self.made[key] = teacher
        return self.made[key]

    def onnx_batch(self, quant: str, rows: Optional[int] = None):
        """An empty KVBatch of `rows` rows (batch_rows when None) of the target engine at `quant` (exported once by
        `targets`, loaded once; one batch per rows asked for, until `keep_rows`)."""
        rows = rows or self.batch_rows
        engine_key, key = ("onnx engine", quant), ("onnx", quant, rows)
        if engine_key not in self.made:
            from specpipe.engines import load_engine

            if self.targets is None:
                raise ValueError("an ONNX teacher needs the run's exported targets")
            # workers that block, not spin, between calls: the probe interleaves torch calls with this engine's,
            # and a spinning worker would take a core from them (a 48-row step is long: blocking costs it little)
            self.made[engine_key] = load_engine(self.targets.folder(quant), threads=self.threads, spinning=False)
        if key not in self.made:
            self.made[key] = self.made[engine_key].new_batch(rows)
        return self.made[key]

    def keep_rows(self, rows: int) -> None:
        """Drop the ONNX batches of any other row count (choose_answer_rows measured them; each holds its KV buffer)
        and answer `rows` at once from here on."""
        self.batch_rows = rows
        for key in [k for k in self.made if k[0] == "onnx" and k[2] != rows]:
            del self.made[key]

    def answerer(self, teacher: Teacher, rows: Optional[int] = None) -> Callable[..., list]:
        """The teacher's answer function: (prompt_ids, kinds=, max_new_tokens=, ...) -> TeacherSequence records, for at
        most `rows` prompts a call (batch_rows when None; a torch teacher takes any number)."""
        from specpipe.distill.teacher import answer_prompts, answer_prompts_onnx

        if teacher.engine == "torch":
            return functools.partial(answer_prompts, self.torch_model(teacher.precision))
        return functools.partial(answer_prompts_onnx, self.onnx_batch(teacher.precision, rows))

    def probe(self, teacher: Teacher, prompt_ids: list[list[int]]) -> Callable[[], int]:
        """A call answering PROBE_ROWS (at most a batch) short prompts (real prompts' first tokens) with PROBE_NEW_TOKENS greedy tokens
        each, features included when the run keeps them: returns the answer tokens it made."""
        rows = [list(prompt_ids[i % len(prompt_ids)][:PROBE_PROMPT_TOKENS]) for i in range(min(PROBE_ROWS, self.batch_rows))]
        return self._answering(teacher, rows, PROBE_NEW_TOKENS)

    def runoff(self, teacher: Teacher, prompt_ids: list[list[int]]) -> Callable[[], int]:
        """A call answering the run's first batch (`prompt_ids`: chat-formatted, at most batch_rows of them) with
        RUNOFF_NEW_TOKENS greedy tokens each, features included when the run keeps them: returns the answer tokens."""
        return self._answering(teacher, [list(ids) for ids in prompt_ids[: self.batch_rows]], RUNOFF_NEW_TOKENS)

    def rows_call(self, teacher: Teacher, prompt_ids: list[list[int]]) -> Callable[[], int]:
        """A call answering `prompt_ids` (chat-formatted: the run's first prompts, as many as the rows measured) with
        ROWS_NEW_TOKENS greedy tokens each, features included when the run keeps them: returns the answer tokens. The
        ONNX teacher answers them from a KV batch of that many rows."""
        return self._answering(teacher, [list(ids) for ids in prompt_ids], ROWS_NEW_TOKENS, batch_rows=len(prompt_ids))

    def _answering(self, teacher: Teacher, rows: list[list[int]], new_tokens: int,
                   batch_rows: Optional[int] = None) -> Callable[[], int]:
        answer = self.answerer(teacher, batch_rows)

        def call() -> int:
            sequences = answer(rows, kinds=["probe"] * len(rows), max_new_tokens=new_tokens, eos_token_ids=set(),
                               pad_token_id=0, top_k=self.top_k, feature_layers=self.feature_layers)
            return sum(s.answer_tokens for s in sequences)

        return call

    def release(self) -> None:
        if self.lent_attention is not None:
            self.model.set_attn_implementation(self.lent_attention)
            self.lent_attention = None
        self.made.clear()


def choose_teacher(names: Sequence[Teacher], device, make_call: Callable[[Teacher], Callable[[], int]],
                   measure: Optional[Callable[..., dict]] = None,
                   make_runoff: Optional[Callable[[Teacher], Callable[[], int]]] = None):
    """The fastest of `names` by its probe (precision.compare: interleaved, medians), as a PrecisionChoice of phase
    "teacher" whose dtype is the teacher's name ("torch bfloat16", "onnx int8-wo"); one candidate is not measured.
    With `make_runoff` (Teachers.runoff), the candidates within RUNOFF_WITHIN of the probe's best are measured again
    on the run's own batch and the fastest there is chosen; its rates join the probe's, named "... (run-off)"."""
    from specpipe.distill.precision import PrecisionChoice, choose_precision, compare

    by_name = {t.name: t for t in names}
    requested = "auto" if len(by_name) > 1 else next(iter(by_name))
    measure = measure or compare
    probed = choose_precision("teacher", requested, device, lambda name: make_call(by_name[name]), names=list(by_name),
                              measure=measure)
    if make_runoff is None or not probed.tokens_per_s:
        return probed
    best = max(probed.tokens_per_s.values())
    close = [name for name, rate in probed.tokens_per_s.items() if rate >= RUNOFF_WITHIN * best]
    if len(close) < 2:
        return probed
    # the probe warmed the candidates (kernels, the batch's buffers): a run-off call (seconds) counts from the first
    runoff_measure = functools.partial(compare, warm_up=False) if measure is compare else measure
    rates = runoff_measure({name: make_runoff(by_name[name]) for name in close}, device)
    return PrecisionChoice("teacher", max(rates, key=rates.get),
                           {**probed.tokens_per_s, **{f"{name} (run-off)": rate for name, rate in rates.items()}})


def choose_answer_rows(candidates: Sequence[int], device, make_call: Callable[[int], Callable[[], int]],
                       measure: Optional[Callable[..., dict]] = None, warm: bool = True):
    """How many prompts a teacher answers at once: each of `candidates` (rows) timed by `make_call(rows)`
    (Teachers.rows_call), interleaved (precision.compare; the run-off warmed the teacher), as a PrecisionChoice of phase
    "teacher rows" whose dtype is the rows chosen ("144") and whose rates are named "48 rows", .... Going up from the
    fewest, more rows replace fewer only at ROWS_GAIN their tokens/s or more. One candidate is not measured. `warm`
    False (no probe ran the teacher): the fewest rows answer once, untimed, first.
    Example: 48 / 96 / 144 rows at 375 / 475 / 490 tokens/s: 96 (490 < 1.05 x 475)."""
    from specpipe.distill.precision import PrecisionChoice, compare

    rows = sorted(dict.fromkeys(int(r) for r in candidates))
    if len(rows) < 2:
        return PrecisionChoice("teacher rows", str(rows[0]), {})
    measure = measure or functools.partial(compare, warm_up=False)
    calls = {f"{r} rows": make_call(r) for r in rows}
    if not warm:
        calls[f"{rows[0]} rows"]()
    rates = measure(calls, device)
    best = rows[0]
    for r in rows[1:]:
        if rates[f"{r} rows"] >= ROWS_GAIN * rates[f"{best} rows"]:
            best = r
    return PrecisionChoice("teacher rows", str(best), rates)
