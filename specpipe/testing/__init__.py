"""Tiny random checkpoints for tests and examples: real Llama architecture, real tokenizer, seconds to make."""
