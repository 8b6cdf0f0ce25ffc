"""The real SmolLM2-135M-Instruct, built as its own draft: speculative output is the target's, token for token."""

import pytest

from specpipe.contract.generation import GenerationConfig
from specpipe.deployment import load_deployment
from specpipe.testing.greedy import assert_greedy_equivalent

pytestmark = pytest.mark.slow


def test_real_model_self_draft_is_lossless(smollm2_self_build):
    deployment = load_deployment(smollm2_self_build)
    manifest = deployment.manifest
    assert manifest.target.checkpoint["num_layers"] == 30
    assert manifest.target.export_check.max_abs_diff < manifest.target.export_check.tolerance
    prompt = deployment.generator.encode("Write a Python function that reverses a string.", chat=True)
    spec = deployment.generator.generate(prompt, GenerationConfig(max_new_tokens=32, num_draft_tokens=4, draft_length="fixed"))
    base = deployment.generator.generate(prompt, GenerationConfig(max_new_tokens=32, speculative=False))
    divergence = assert_greedy_equivalent(deployment, prompt, spec.token_ids, base.token_ids)
    # The draft is the target's own 1-token decode: a rejection means the verify call's argmax differed from
    # it, which makes the outputs diverge there (a near-tie, checked above). Otherwise every draft is accepted.
    assert spec.stats.acceptance_rate == 1.0 or divergence is not None
    assert "def" in spec.text  # the model answers coherently
