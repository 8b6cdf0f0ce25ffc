"""Hugging Face checkpoint -> ONNX graph with a KV cache, and the engine-vs-torch check."""

from specpipe.export.onnx import check_export, export_onnx

__all__ = ["check_export", "export_onnx"]
