"""specpipe: from two Hugging Face checkpoints to a validated speculative-decoding deployment."""

__version__ = "0.1.0"
