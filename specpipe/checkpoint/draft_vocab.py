"""A draft's vocabulary: the tokens its head scores, ranked by how often its training data uses them.

FR-Spec (Zhao et al. 2025, "Frequency-Ranked Speculative Sampling") drafts over the most frequent
tokens only: the head is most of a small draft's cost (SmolLM2: 49152 x 576 weights against 3.5M per
decoder layer), while a few thousand tokens cover nearly all of what the target writes. A token outside
the kept set is simply never proposed (q = 0); the acceptance rule stays exact.

`specpipe distill` writes the ranking into the draft checkpoint (`draft-vocab.json`); `specpipe build`
keeps the top `--draft-vocab` of it (default DEFAULT_SIZE) and slices the draft engine's head to them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from specpipe.errors import UsageError

FILE = "draft-vocab.json"
DEFAULT_SIZE = 8192  # measured on SmolLM2: the top 8192 of 117k answer tokens cover 99.8% of unseen answers


def count_tokens(sequences: Iterable, vocab_size: int) -> np.ndarray:
    """Occurrences of each token id in what a draft is trained to predict: the answers of prompted sequences
    (from `prompt_len` on), the whole of plain-text ones."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for seq in sequences:
        ids = np.asarray(seq.token_ids)[int(seq.prompt_len) :]
        np.add.at(counts, ids[(ids >= 0) & (ids < vocab_size)], 1)
    return counts


def write_ranking(folder: Path, counts: np.ndarray, *, source: str) -> Path:
    """folder/draft-vocab.json: token ids that occur, most frequent first (ties by id), with their counts."""
    seen = np.flatnonzero(counts)
    order = seen[np.lexsort((seen, -counts[seen]))]
    path = Path(folder) / FILE
    record = {"format": 1, "source": source, "vocab_size": int(len(counts)), "tokens": int(counts.sum()),
              "ranked_ids": order.tolist(), "counts": counts[order].tolist()}
    path.write_text(json.dumps(record) + "\n")
    return path


def read_ranking(folder: Path) -> Optional[dict]:
    path = Path(folder) / FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        record["ranked_ids"] = [int(i) for i in record["ranked_ids"]]
        record["counts"] = [int(c) for c in record["counts"]]
    except (ValueError, KeyError, TypeError) as err:
        raise UsageError(f"{path} is not a draft vocabulary ranking ({err})") from None
    return record


def choose_token_ids(folder: Path, size: Optional[int], vocab_size: int, always: Iterable[int] = ()) -> Optional[dict]:
    """The draft head's columns, or None for the whole vocabulary.

    size None: DEFAULT_SIZE when the checkpoint has a ranking, else the whole vocabulary; 0: the whole
    vocabulary; n: the n most frequent tokens (the ranking must exist). `always` (end-of-sequence ids)
    are kept whatever their rank. Tokens the data never used fill any remaining places in id order (BPE
    vocabularies put frequent merges first). Returns {"token_ids": sorted array, "coverage": share of the
    ranked tokens' occurrences the kept ids cover, ...} for the manifest.
    """
    if size == 0:
        return None
    ranking = read_ranking(folder)
    if ranking is None:
        if size is None:
            return None
        raise UsageError(f"--draft-vocab {size}: {folder} has no {FILE} (written by `specpipe distill`); "
                         "pass --draft-vocab 0 to keep the whole vocabulary")
    size = DEFAULT_SIZE if size is None else size
    if ranking.get("vocab_size", vocab_size) != vocab_size:
        raise UsageError(f"{folder / FILE} ranks a {ranking['vocab_size']}-token vocabulary; the draft has {vocab_size}")
    if size >= vocab_size:
        return None
    always = sorted({int(i) for i in always if 0 <= int(i) < vocab_size})
    kept = dict.fromkeys(always)
    for token in ranking["ranked_ids"]:
        if len(kept) >= size:
            break
        kept.setdefault(token)
    for token in range(vocab_size):  # fewer distinct tokens than places: fill in id order
        if len(kept) >= size:
            break
        kept.setdefault(token)
    ids = np.array(sorted(kept), dtype=np.int64)
    counts = dict(zip(ranking["ranked_ids"], ranking["counts"]))
    total = sum(ranking["counts"]) or 1
    return {"token_ids": ids, "size": len(ids), "source": FILE, "ranked_tokens": int(total),
            "coverage": round(sum(counts.get(int(i), 0) for i in ids) / total, 5)}


def top_token_ids(counts: np.ndarray, size: int, always: Iterable[int] = ()) -> np.ndarray:
    """The `size` most frequent token ids of `counts` (ties by id), `always` included whatever their rank, then
    unused ids in id order if fewer tokens occur; sorted. The same rule as `choose_token_ids`, for a vocabulary
    chosen at training time (an EAGLE-3 head's lm_head rows, `d2t`/`t2d`)."""
    vocab_size = len(counts)
    size = min(int(size), vocab_size)
    kept = dict.fromkeys(sorted({int(i) for i in always if 0 <= int(i) < vocab_size}))
    seen = np.flatnonzero(counts)
    for token in seen[np.lexsort((seen, -counts[seen]))]:
        if len(kept) >= size:
            break
        kept.setdefault(int(token))
    for token in range(vocab_size):
        if len(kept) >= size:
            break
        kept.setdefault(token)
    return np.array(sorted(kept), dtype=np.int64)
