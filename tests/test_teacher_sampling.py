"""The teacher's sampler (distill/teacher.py `sample_rows`) draws from softmax(logits / temperature).

Chi-square against the exact probabilities, per row of a batch whose rows differ, with a token of probability 0
that must never be drawn; a planted sampler that ignores the temperature must fail the same test.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specpipe.distill.teacher import sample_rows

ALPHA = 1e-4
DRAWS = 40_000


def _logits() -> torch.Tensor:
    rows = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5, float("-inf")],
                         [3.0, -2.0, 0.0, 0.0, 1.0, 1.5]])
    return rows


def _counts(sampler, logits, temperature, generator) -> torch.Tensor:
    batch = logits.repeat(DRAWS // 2, 1)  # rows alternate 0, 1, 0, 1, ...
    tokens = sampler(batch, temperature, generator)
    counts = torch.zeros(len(logits), logits.shape[1])
    for row in range(len(logits)):
        counts[row] = torch.bincount(tokens[row:: len(logits)], minlength=logits.shape[1]).float()
    return counts


def _p_values(counts, logits, temperature) -> list[float]:
    probs = torch.softmax(logits / temperature, dim=-1)
    values = []
    for row in range(len(logits)):
        keep = probs[row] > 0
        expected = probs[row][keep] * counts[row].sum()
        values.append(float(chisquare(counts[row][keep].numpy(), expected.numpy()).pvalue))
    return values


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_draws_follow_the_tempered_softmax(temperature):
    logits, generator = _logits(), torch.Generator().manual_seed(0)
    counts = _counts(sample_rows, logits, temperature, generator)
    assert counts[0, 5] == 0  # probability 0: never drawn
    assert min(_p_values(counts, logits, temperature)) > ALPHA


def test_a_sampler_that_ignores_the_temperature_fails():
    def planted(logits, temperature, generator):
        return sample_rows(logits, 1.0, generator)

    logits, generator = _logits(), torch.Generator().manual_seed(0)
    counts = _counts(planted, logits, 0.7, generator)
    assert min(_p_values(counts, logits, 0.7)) < ALPHA


def test_the_same_generator_gives_the_same_draws():
    logits = torch.randn(48, 1000, generator=torch.Generator().manual_seed(1))
    first = sample_rows(logits, 0.7, torch.Generator().manual_seed(3))
    again = sample_rows(logits, 0.7, torch.Generator().manual_seed(3))
    assert torch.equal(first, again) and first.shape == (48,)
