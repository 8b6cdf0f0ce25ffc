"""The target drafting for itself (`--draft self:int4-wo` / `self:int8-wo`): its own engine, weight-only quantized."""

from __future__ import annotations

import time
from typing import ClassVar, Literal, Optional

from specpipe.contract.decoding import DecodingPolicy
from specpipe.contract.manifest import DraftEntry, EngineRecord, Prediction, QuantRecord, file_hashes
from specpipe.contract.quant import QuantConfig, QuantMode
from specpipe.drafts.base import DraftKind
from specpipe.engines import load_engine
from specpipe.speculative.drafters import ModelDrafter


class SelfDecoding(DecodingPolicy):
    """A model draft on the target's own quantized graph: CPU engines only (the GPU builds quantize with ModelOpt)."""

    backends = ("onnxruntime",)


class SelfDraft(DraftEntry):
    """The target's own engine, weight-only quantized (`--draft self:MODE`)."""

    kind: Literal["self"] = "self"
    source: str
    engine: EngineRecord
    quant: QuantRecord
    prediction: Optional[Prediction] = None
    policy: ClassVar = SelfDecoding

    @property
    def quant_mode(self) -> QuantMode:
        return self.quant.mode

    def paths(self) -> list[str]:
        return [self.engine.path] + ([self.quant.reference_path] if self.quant.reference_path else [])


class SelfKind(DraftKind):
    name = "self"
    entry = SelfDraft
    has_engine = True

    @classmethod
    def claims(cls, spec):
        return spec.startswith("self:")

    @classmethod
    def drafter(cls, folder, entry, target, threads):
        return ModelDrafter(load_engine(folder / entry.engine.path, threads=threads), target.vocab_size)

    @classmethod
    def build(cls, spec, out, ctx):
        """Quantized from the unquantized target engine (`target/`, or `target-fp32/` when --quant quantized the
        target). Its accuracy is measured and recorded but never fails the build: a draft's precision changes how
        often it is accepted, never the output."""
        from specpipe.quantize import quantize_engine

        mode = spec.removeprefix("self:")
        target_entry = ctx.target_entry
        reference = (target_entry.quant.reference_path if target_entry.quant else None) or target_entry.engine.path
        t0 = time.perf_counter()
        ctx.say(f"quantizing the target ({mode}) as its own draft")
        quant = quantize_engine(ctx.stage / reference, out / "draft", QuantConfig(mode=mode, accept_accuracy_loss=True),
                                ctx.tokenizer, model_name="self-draft", threads=ctx.cfg.backend.threads)
        ctx.timings["draft_quantize_s"] = time.perf_counter() - t0
        return SelfDraft(
            kind="self", source=f"{spec} of {target_entry.source}",
            engine=EngineRecord(path="draft", backend="onnxruntime", quant=mode, files=file_hashes(out / "draft")),
            quant=QuantRecord(**quant, reference_path=reference),
        )  # fmt: skip

    @classmethod
    def describe(cls, entry):
        return [f"{entry.source}: top-1 agreement with the target {entry.quant.accuracy.top1_agreement:.3f}"]
