"""Inference engines behind one interface. GPU backends are imported lazily by `load_engine`."""

from specpipe.engines.base import Engine, EngineSequence, load_engine

__all__ = ["Engine", "EngineSequence", "load_engine"]
