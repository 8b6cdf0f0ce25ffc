"""The real SmolLM2-135M-Instruct, built as its own draft: speculative output is the target's, token for token."""

import pytest

from specpipe.config import GenerationConfig
from specpipe.deployment import load_deployment

pytestmark = pytest.mark.slow


def test_real_model_self_draft_is_lossless(smollm2_self_build):
    deployment = load_deployment(smollm2_self_build)
    manifest = deployment.manifest
    assert manifest.target.checkpoint["num_layers"] == 30
    assert manifest.target.export_check.max_abs_diff < manifest.target.export_check.tolerance
    prompt = deployment.generator.encode("Write a Python function that reverses a string.", chat=True)
    spec = deployment.generator.generate(prompt, GenerationConfig(max_new_tokens=32, num_draft_tokens=4, draft_length="fixed"))
    base = deployment.generator.generate(prompt, GenerationConfig(max_new_tokens=32, speculative=False))
    assert spec.token_ids == base.token_ids
    assert spec.stats.acceptance_rate == 1.0
    assert "def" in spec.text  # the model answers coherently
