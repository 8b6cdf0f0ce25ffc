"""Teacher data: token sequences with the target's next-token distribution at every position, kept as top-k.

The target answers training prompts (greedy first, sampled once the prompts run out); the logits it
computes while generating are exactly the teacher's distributions along its own answers, so they are
kept (top-k log-probabilities) and no second teacher pass is needed. Epochs over the data are then
cheap: the target is never run during training.

Two teachers give the same records: `answer_prompts` runs the checkpoint in torch (left-padded batch, transformers'
KV cache); `answer_prompts_onnx` runs the target as `build` deploys it, an ONNX Runtime engine over a shared KV buffer
(engines/shared_kv.py), so its distributions and features are those the head reads when serving.

Data is written in shards to a cache folder keyed by the target's weights, the teacher and the generation settings,
so an interrupted run resumes generating where it stopped and a rerun reuses what exists.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import torch

SHARD_GLOB = "shard-*.pt"
SHARED_PREFIX_MIN = 8  # answer_prompts_onnx runs a prefix its prompts share once when it is at least this long
META = "meta.json"


@dataclass
class TeacherSequence:
    """One training sequence. Row t of top_ids/top_logprobs is the target's distribution over token t+1."""

    token_ids: torch.Tensor  # [T] int64
    top_ids: torch.Tensor  # [T-1, k] int32, most likely first
    top_logprobs: torch.Tensor  # [T-1, k] float16, log p (full-vocabulary softmax)
    prompt_len: int  # tokens before the answer (chat template + prompt); 0 for plain text
    kind: str  # "code" | "chat" | "stdlib" | "custom"
    # EAGLE-3 features, recorded in the same pass when asked: row t = the target's residual stream at position t after
    # each feature layer, concatenated ([T-1, len(layers) * hidden] float16; export/features.py). None otherwise.
    features: Optional[torch.Tensor] = None

    def cut(self, tokens: int) -> "TeacherSequence":
        """The first `tokens` tokens, with their distributions (and features) for the tokens after each."""
        return TeacherSequence(self.token_ids[:tokens], self.top_ids[: tokens - 1], self.top_logprobs[: tokens - 1],
                               min(self.prompt_len, tokens - 1), self.kind,
                               None if self.features is None else self.features[: tokens - 1])

    def __len__(self) -> int:
        return int(self.token_ids.numel())

    @property
    def answer_tokens(self) -> int:
        return len(self) - self.prompt_len if self.prompt_len else 0

    def to_dict(self) -> dict:
        names = ("token_ids", "top_ids", "top_logprobs", "prompt_len", "kind") + (() if self.features is None else ("features",))
        return {k: getattr(self, k) for k in names}


def prompts_of(sequences: Sequence[TeacherSequence]) -> list[list[int]]:
    """The sequences' prompts (chat template and prompt: the tokens before each answer), each once, in order."""
    prompts: dict[tuple[int, ...], None] = {}
    for s in sequences:
        if s.prompt_len:
            prompts.setdefault(tuple(int(t) for t in s.token_ids[: s.prompt_len].tolist()), None)
    return [list(p) for p in prompts]


class TeacherCache:
    """A folder of shards plus meta.json ({"key": settings, "seconds": generation time so far, ...})."""

    def __init__(self, folder: Path, key: dict):
        self.folder = Path(folder)
        self.key = key
        self.folder.mkdir(parents=True, exist_ok=True)
        meta_path = self.folder / META
        self.meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {"key": key, "seconds": 0.0, "answered": 0}

    @classmethod
    def for_settings(cls, root: Path, key: dict) -> "TeacherCache":
        return cls(cls._folder(root, key), key)

    @classmethod
    def existing(cls, root: Path, key: dict) -> Optional["TeacherCache"]:
        """The cache for these settings if one was written, else None (nothing is created)."""
        folder = cls._folder(root, key)
        return cls(folder, key) if (folder / META).is_file() else None

    @staticmethod
    def _folder(root: Path, key: dict) -> Path:
        return Path(root) / hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def seconds(self) -> float:
        return float(self.meta["seconds"])

    @property
    def answered(self) -> int:
        return int(self.meta["answered"])

    @property
    def answer_tokens(self) -> int:
        """Answer tokens in the cache (caches written before this count existed are counted once)."""
        if "answer_tokens" not in self.meta:
            self.meta["answer_tokens"] = sum(s.answer_tokens for s in self.load())
        return int(self.meta["answer_tokens"])

    def load(self, max_answer_tokens: Optional[int] = None) -> list[TeacherSequence]:
        """The shards in the order they were made; with a budget, only as many as a run with that budget
        made (it stops after the shard that reaches the budget), so a larger cache gives the same data."""
        sequences, tokens = [], 0
        for shard in sorted(self.folder.glob(SHARD_GLOB)):
            if max_answer_tokens is not None and tokens >= max_answer_tokens:
                break
            items = [TeacherSequence(**item) for item in torch.load(shard, weights_only=True)]
            sequences += items
            tokens += sum(s.answer_tokens for s in items)
        return sequences

    def append(self, sequences: list[TeacherSequence], seconds: float, answered: int) -> None:
        """Write one shard, then the meta that counts it (a crash between the two loses nothing but time)."""
        index = len(list(self.folder.glob(SHARD_GLOB)))
        tmp = self.folder / f".shard-{index:05d}.tmp"
        torch.save([s.to_dict() for s in sequences], tmp)
        tmp.rename(self.folder / f"shard-{index:05d}.pt")
        self.meta.update(seconds=self.seconds + seconds, answered=self.answered + answered,
                         answer_tokens=self.answer_tokens + sum(s.answer_tokens for s in sequences))
        (self.folder / META).write_text(json.dumps(self.meta, indent=1))


def sample_rows(logits: torch.Tensor, temperature: float, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row drawn from softmax(logits / temperature): logits [rows, V] -> token ids [rows].

    Inverse CDF: a uniform draw per row, scaled to the row's total, searched in its cumulative probabilities (the
    first token whose cumulative sum exceeds it, so a token of probability 0 is never drawn). The same distribution
    as torch.multinomial, which on a [48, 49152] batch took 51 ms a step against 2.7 ms for this (Zen 4, 2 threads,
    2026-11-25): the teacher pass draws a batch every step, and multinomial took about as long as the target's own
    48-row step."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    cumulative = probs.cumsum(dim=-1)
    draws = torch.rand(len(probs), 1, generator=generator) * cumulative[:, -1:]
    return torch.searchsorted(cumulative, draws, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)


def _top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] -> (ids int32 [..., k], log-probs float16 [..., k]), on the CPU (where the cache lives)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logprobs.topk(k, dim=-1)
    return ids.to(torch.int32).cpu(), values.to(torch.float16).cpu()


@torch.inference_mode()
def answer_prompts(
    model,
    prompt_ids: list[list[int]],
    *,
    kinds: list[str],
    max_new_tokens: int,
    eos_token_ids: set[int],
    pad_token_id: int,
    top_k: int,
    temperature: float = 0.0,
    generator: Optional[torch.Generator] = None,
    feature_layers: Sequence[int] = (),
    deadline: Optional[float] = None,
) -> list[TeacherSequence]:
    """Let the target answer a batch of prompts (left-padded, KV cache), keeping its top-k at every position.

    temperature 0 = greedy. Rows that finished keep stepping on pad tokens (ignored) until all are done.
    deadline (a time.perf_counter() value): stop stepping there and keep every answer as far as it got (a cut
    answer is still the target's own continuation): a batch of 48 answers x 160 tokens on a loaded 2-core machine
    ran ~7 minutes past the time cap it started under (the 2026-11-24 demo).
    feature_layers (layer-output ids): also keep the residual stream after those layers at every position, from the
    same forward passes (EAGLE-3 features; no second target pass).
    """
    from specpipe.export.features import hf_hidden_state_index

    taps = [hf_hidden_state_index(i) for i in feature_layers]

    def features_of(out) -> Optional[torch.Tensor]:  # [batch, n, len(taps) * hidden] float16 on the CPU
        if not taps:
            return None
        return torch.cat([out.hidden_states[i] for i in taps], dim=-1).to(torch.float16).cpu()

    batch = len(prompt_ids)
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    for row, ids in enumerate(prompt_ids):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        mask[row, width - len(ids) :] = 1
    device = next(model.parameters()).device
    input_ids, mask = input_ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                output_hidden_states=bool(taps))
    # float32 once a step: the top-k and the greedy argmax both read it (an argmax over bf16 logits took 3 ms more
    # than the conversion and one over float32, a 48-row step's ~2.5%)
    cache, logits = out.past_key_values, out.logits[:, -1].float()
    prompt_tops = [_top_k(out.logits[row, width - len(ids) :], top_k) for row, ids in enumerate(prompt_ids)]
    prompt_features = features_of(out)
    step_features: list[torch.Tensor] = []  # per decode step: [batch, 1, F]
    del out

    answers: list[list[int]] = [[] for _ in range(batch)]
    answer_tops: list[list[tuple]] = [[] for _ in range(batch)]
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    next_pos = positions[:, -1] + 1
    for _ in range(max_new_tokens):
        if deadline is not None and time.perf_counter() >= deadline and any(answers):
            break
        ids, logprobs = _top_k(logits, top_k)
        if temperature > 0:  # sampled on the CPU: the same generator gives the same answers on any device
            tokens = sample_rows(logits.cpu(), temperature, generator).to(device)
        else:
            tokens = logits.argmax(-1)
        for row in range(batch):
            if done[row]:
                continue
            answer_tops[row].append((ids[row], logprobs[row]))
            answers[row].append(int(tokens[row]))
            if int(tokens[row]) in eos_token_ids:
                done[row] = True
        if bool(done.all()):
            break
        tokens = torch.where(done, torch.full_like(tokens, pad_token_id), tokens)
        mask = torch.cat([mask, (~done).long()[:, None]], dim=1)
        out = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                    past_key_values=cache, use_cache=True, output_hidden_states=bool(taps))
        cache, logits = out.past_key_values, out.logits[:, -1].float()
        if taps:
            step_features.append(features_of(out))
        next_pos = next_pos + 1

    sequences = []
    for row, ids in enumerate(prompt_ids):
        answer = answers[row]
        # Rows predicting tokens 1..T-1: prompt rows 0..P-1 (the last one predicts the first answer token),
        # then answer rows for answer tokens 2..; the row after the final token predicts nothing we keep.
        top_ids = torch.cat([prompt_tops[row][0]] + [t[0][None] for t in answer_tops[row][1:]])
        top_lp = torch.cat([prompt_tops[row][1]] + [t[1][None] for t in answer_tops[row][1:]])
        token_ids = torch.tensor(ids + answer, dtype=torch.long)
        features = None
        if taps:  # positions 0..T-2: the prompt's, then one per answer token the target ran on
            rows = [prompt_features[row, width - len(ids) :]] + [f[row] for f in step_features[: len(answer) - 1]]
            features = torch.cat(rows)[: len(token_ids) - 1]
        sequences.append(TeacherSequence(token_ids, top_ids[: len(token_ids) - 1], top_lp[: len(token_ids) - 1],
                                         len(ids), kinds[row], features))
    return sequences


def answer_prompts_onnx(
    batch,
    prompt_ids: list[list[int]],
    *,
    kinds: list[str],
    max_new_tokens: int,
    eos_token_ids: set[int],
    top_k: int,
    temperature: float = 0.0,
    generator: Optional[torch.Generator] = None,
    feature_layers: Sequence[int] = (),
    deadline: Optional[float] = None,
    pad_token_id: Optional[int] = None,  # unused: rows are never padded here (answer_prompts' signature)
) -> list[TeacherSequence]:
    """`answer_prompts` on the target's ONNX Runtime engine: the same records, from an empty `batch` (a KVBatch of
    an engine exported with `feature_layers` when those are asked for; it is empty again on return).

    One call per row runs its prompt (`append` on the empty row: the logits of every prompt position), then one
    `decode` call per step runs all the rows still answering. A row that has its answer (EOS, max_new_tokens, the
    deadline) is released at once, so calls shrink as answers end, and its last token is never run: nothing reads
    what the target would say after it (answer_prompts keeps no row for it either).
    """
    if feature_layers and tuple(feature_layers) != tuple(batch.engine.feature_layers):
        raise ValueError(f"the engine outputs features of layers {list(batch.engine.feature_layers)}, "
                         f"not {list(feature_layers)}")
    rows = [batch.new_sequence() for _ in prompt_ids]
    try:
        return _answer_rows(batch, rows, prompt_ids, kinds=kinds, max_new_tokens=max_new_tokens,
                            eos_token_ids=eos_token_ids, top_k=top_k, temperature=temperature, generator=generator,
                            keep_features=bool(feature_layers), deadline=deadline)
    finally:  # the batch is empty again, also after an error
        for row in rows:
            if row.slot >= 0:
                batch.release(row)


def _answer_rows(batch, rows, prompt_ids, *, kinds, max_new_tokens, eos_token_ids, top_k, temperature, generator,
                 keep_features, deadline) -> list[TeacherSequence]:
    """answer_prompts_onnx's work on its rows (one per prompt, nothing cached yet)."""
    import numpy as np

    for row in rows if keep_features else ():
        row.keep_features()
    # A call per prompt, not one right-padded call for all: measured 2x faster (SmolLM2-135M, 48 chat prompts of
    # 2,125 tokens, 1 thread, loaded: int8-wo 7.2 s vs 11.3-17.3 s, fp32 9.8-10.2 s vs 22-25 s; docs/eagle3.md).
    # The tokens every prompt starts with (the chat template's system turn: 24 of SmolLM2's ~44) run once: the
    # other rows start from a copy of their keys and values, and their records from a copy of its rows (a row's
    # distribution and features depend only on the tokens up to it).
    shared = shared_prefix_length(prompt_ids)
    prefix = None  # (KVPrefix, its top-k ids and log-probs, its features)
    prompt_tops, prompt_features, last_logits = [], [], []
    for row, ids in zip(rows, prompt_ids):
        if prefix is None:
            logits = row.append(ids)  # [P, vocab]
            tops = _top_k(torch.from_numpy(logits), top_k)
            features = torch.from_numpy(row.features).to(torch.float16) if keep_features else None
            if shared:
                prefix = (row.save_prefix(shared), (tops[0][:shared], tops[1][:shared]),
                          features[:shared] if keep_features else None)
        else:
            row.load_prefix(prefix[0])
            logits = row.append(ids[shared:])  # [P - shared, vocab]
            own = _top_k(torch.from_numpy(logits), top_k)
            tops = (torch.cat([prefix[1][0], own[0]]), torch.cat([prefix[1][1], own[1]]))
            features = (torch.cat([prefix[2], torch.from_numpy(row.features).to(torch.float16)]) if keep_features
                        else None)
        prompt_tops.append(tops)
        prompt_features.append(features)
        last_logits.append(logits[-1].copy())  # not a view: the prompt's logits go now
    logits = torch.from_numpy(np.stack(last_logits))  # [running, vocab]
    del last_logits

    answers: list[list[int]] = [[] for _ in rows]
    answer_tops: list[list[tuple]] = [[] for _ in rows]  # rows for answer tokens 2.. (the prompt's last row is the 1st)
    answer_features: list[list[torch.Tensor]] = [[] for _ in rows]
    running = list(range(len(rows)))  # indices into rows, in the order of `logits`
    while running:
        if temperature > 0:
            tokens = sample_rows(logits, temperature, generator)
        else:
            tokens = logits.argmax(-1)
        for i, token in zip(running, tokens.tolist()):
            answers[i].append(int(token))
        finished = {i for i in running if answers[i][-1] in eos_token_ids or len(answers[i]) >= max_new_tokens}
        for i in finished:
            batch.release(rows[i])
        running = [i for i in running if i not in finished]
        if not running:
            break
        if deadline is not None and time.perf_counter() >= deadline:  # every row keeps its answer as far as it got
            break
        logits = torch.from_numpy(batch.decode([rows[i] for i in running], [answers[i][-1] for i in running]))
        ids, logprobs = _top_k(logits, top_k)
        for j, i in enumerate(running):
            answer_tops[i].append((ids[j], logprobs[j]))
            if keep_features:
                answer_features[i].append(torch.from_numpy(rows[i].features).to(torch.float16))

    sequences = []
    for i, ids in enumerate(prompt_ids):
        token_ids = torch.tensor(list(ids) + answers[i], dtype=torch.long)
        top_ids = torch.cat([prompt_tops[i][0]] + [t[0][None] for t in answer_tops[i]])
        top_lp = torch.cat([prompt_tops[i][1]] + [t[1][None] for t in answer_tops[i]])
        features = torch.cat([prompt_features[i]] + answer_features[i]) if keep_features else None
        assert len(top_ids) == len(token_ids) - 1  # row t predicts token t+1; the last token's row is never made
        sequences.append(TeacherSequence(token_ids, top_ids, top_lp, len(ids), kinds[i], features))
    return sequences


def chat_ids(tokenizer, prompts: Sequence[dict]) -> list[list[int]]:
    """Each training prompt ({"prompt": text, ...}) as the target reads it: a user turn in its chat template."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True,
                                          tokenize=True) for p in prompts]


def shared_prefix_length(prompt_ids: Sequence[Sequence[int]], at_least: int = SHARED_PREFIX_MIN) -> int:
    """Tokens all of `prompt_ids` (two or more) start with, each prompt keeping at least one of its own; 0 when that
    is under `at_least` (too short to be worth a copy)."""
    if len(prompt_ids) < 2:
        return 0
    length = min(len(ids) for ids in prompt_ids) - 1
    first = prompt_ids[0]
    for ids in prompt_ids[1:]:
        length = next((i for i in range(length) if ids[i] != first[i]), length)
    return length if length >= at_least else 0


@torch.inference_mode()
def label_text(model, token_ids: list[int], *, top_k: int, kind: str) -> TeacherSequence:
    """Teacher distributions along a given text (no generation): one forward pass."""
    ids = torch.tensor(token_ids, dtype=torch.long)[None]
    logits = model(input_ids=ids.to(next(model.parameters()).device)).logits[0, :-1]
    top_ids, top_lp = _top_k(logits, top_k)
    return TeacherSequence(ids[0], top_ids, top_lp, 0, kind)


def stdlib_windows(tokenizer, *, window: int, seed: int) -> Iterable[list[int]]:
    """Windows of `window` tokens from the Python standard library's own source (always there, offline)."""
    stdlib = Path(sys.modules["os"].__file__).parent
    files = sorted(p for p in stdlib.glob("*.py") if p.stat().st_size > 2000)
    random.Random(seed).shuffle(files)
    for path in files:
        ids = tokenizer(path.read_text(errors="replace"))["input_ids"]
        for start in range(0, max(1, len(ids) - window), window * 4):  # every 4th window: spread over files
            chunk = ids[start : start + window]
            if len(chunk) >= window // 2:
                yield chunk


def generate_teacher_data(
    answer: Callable[..., list[TeacherSequence]],
    tokenizer,
    cache: TeacherCache,
    prompts: list[dict],
    *,
    budget_s: float,
    budget_tokens: Optional[int] = None,
    batch_size: int,
    max_new_tokens: int,
    eos_token_ids: set[int],
    top_k: int,
    sample_temperature: float,
    seed: int,
    on_batch: Callable[[int, float], None] = lambda tokens, seconds: None,
    feature_layers: Sequence[int] = (),
) -> None:
    """Answer prompts in order with `answer` (answer_prompts with its model, or answer_prompts_onnx with its
    batch, the first argument bound) until the cache holds `budget_tokens` answer tokens (a work budget: the
    same answers on any machine), or, without one, until its generation time reaches `budget_s`. With a
    work budget, `budget_s` caps this call's time.

    The first pass over the prompt list is greedy (what the benchmark decodes); later passes sample at
    `sample_temperature`, so extra budget still adds new, varied answers. A cache that has already spent
    the budget is used as it is.
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_token_ids)
    started = time.perf_counter()

    def more() -> bool:
        if budget_tokens is None:
            return cache.seconds < budget_s
        return cache.answer_tokens < budget_tokens and time.perf_counter() - started < budget_s

    # the cap holds inside a batch too: a time budget ends where the cache's generation time reaches it
    deadline = started + (budget_s - cache.seconds if budget_tokens is None else budget_s)

    while more():
        start = cache.answered
        round_index, offset = divmod(start, len(prompts))
        chosen = prompts[offset : offset + batch_size]
        ids = chat_ids(tokenizer, chosen)
        generator = torch.Generator().manual_seed(seed * 100003 + start)
        t0 = time.perf_counter()
        sequences = answer(
            ids, kinds=[p["kind"] for p in chosen], max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids,
            pad_token_id=pad, top_k=top_k, temperature=0.0 if round_index == 0 else sample_temperature,
            generator=generator, feature_layers=feature_layers, deadline=deadline,
        )
        seconds = time.perf_counter() - t0
        cache.append(sequences, seconds, len(chosen))
        on_batch(sum(len(s) - s.prompt_len for s in sequences), seconds)
