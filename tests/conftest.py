"""Shared fixtures: tiny random Llama pairs saved as real HF checkpoints in a session tmp dir."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _cuda_ready() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_ready():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (gpu-marked); runs on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from specpipe.testing.tiny import make_tokenizer

    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_target(tiny_dir, tiny_tokenizer) -> Path:
    """Target: 2 layers, hidden 64, seed 0."""
    from specpipe.testing.tiny import make_tiny_llama

    return make_tiny_llama(tiny_dir / "target", seed=0, num_layers=2, tokenizer=tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_draft(tiny_dir, tiny_tokenizer) -> Path:
    """An unrelated random draft with the same tokenizer (low acceptance): 1 layer, hidden 32, seed 1."""
    from specpipe.testing.tiny import make_tiny_llama

    return make_tiny_llama(tiny_dir / "draft", seed=1, num_layers=1, hidden_size=32, tokenizer=tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_other_vocab(tiny_dir) -> Path:
    """A model whose tokenizer differs (different vocab): incompatible with tiny_target."""
    from specpipe.testing.tiny import make_tiny_llama, make_tokenizer

    return make_tiny_llama(tiny_dir / "other_vocab", seed=2, num_layers=1, tokenizer=make_tokenizer(290))


@pytest.fixture(scope="session")
def tiny_padded_draft(tiny_dir, tiny_tokenizer) -> Path:
    """Same tokenizer, embedding matrix padded with rows no token maps to (the Qwen case): compatible."""
    from specpipe.testing.tiny import make_tiny_llama

    return make_tiny_llama(
        tiny_dir / "padded_draft", seed=3, num_layers=1, tokenizer=tiny_tokenizer, model_vocab_size=len(tiny_tokenizer) + 64
    )


@pytest.fixture(scope="session")
def tiny_engines_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="session")
def tiny_build(tiny_target, tiny_draft, tiny_engines_dir) -> Path:
    """engines/pair: tiny_target + unrelated tiny_draft, built once per session."""
    from specpipe.builder import build
    from specpipe.builder.config import BuildConfig

    return build(BuildConfig(target=str(tiny_target), draft=str(tiny_draft), name="pair",
                             engines_dir=tiny_engines_dir, repo_dir=None))


@pytest.fixture(scope="session")
def tiny_self_build(tiny_target, tiny_engines_dir) -> Path:
    """engines/self: tiny_target as its own draft (greedy acceptance must be 1.0)."""
    from specpipe.builder import build
    from specpipe.builder.config import BuildConfig

    return build(BuildConfig(target=str(tiny_target), draft=str(tiny_target), name="self",
                             engines_dir=tiny_engines_dir, repo_dir=None))


@pytest.fixture(scope="session")
def smollm2_self_build(tmp_path_factory) -> Path:
    """The real SmolLM2-135M-Instruct as both target and draft (greedy acceptance must be 1.0). Minutes."""
    from specpipe.builder import build
    from specpipe.builder.config import BuildConfig

    return build(BuildConfig(target="smollm2-135m", draft="smollm2-135m", name="smollm2-self",
                             engines_dir=tmp_path_factory.mktemp("real"), repo_dir=None))
