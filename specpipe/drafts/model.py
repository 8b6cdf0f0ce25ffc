"""A draft model (`--draft CHECKPOINT`): a small causal LM sharing the target's tokenizer, exported to its own
engine; the kind every --draft value is that no other kind claims."""

from __future__ import annotations

import os
import shutil
from typing import ClassVar, Literal

from specpipe.contract.decoding import DecodingPolicy
from specpipe.contract.manifest import DraftEntry, ModelEntry
from specpipe.drafts.base import DraftKind
from specpipe.engines import load_engine
from specpipe.speculative.drafters import ModelDrafter


class ModelDecoding(DecodingPolicy):
    """TensorRT-LLM's DraftTargetDecodingConfig."""

    decoding_type = "Draft_Target"


class ModelDraft(ModelEntry, DraftEntry):
    kind: Literal["model"] = "model"
    policy: ClassVar = ModelDecoding

    @classmethod
    def of(cls, entry: ModelEntry, **changes) -> "ModelDraft":
        """A built model's entry as the draft's, with `changes` (the fields its builder set, no more)."""
        return cls(kind="model", **{**{key: getattr(entry, key) for key in entry.model_fields_set}, **changes})


class ModelKind(DraftKind):
    name = "model"
    entry = ModelDraft
    has_engine = True
    has_checkpoint = True

    @classmethod
    def claims(cls, spec):
        return True  # asked last: a checkpoint folder, a .gguf file or an alias

    @classmethod
    def drafter(cls, folder, entry, target, threads):
        return ModelDrafter(load_engine(folder / entry.engine.path, threads=threads), target.vocab_size)

    @classmethod
    def build(cls, spec, out, ctx):
        """The draft checkpoint exported like the target (builder/cpu.py `export`), with the exporter `draft_graph`
        picks; a draft that is the target itself, at the same precision, reuses the target's engine."""
        from specpipe.checkpoint import inspect_checkpoint

        cfg, draft, target_entry = ctx.cfg, ctx.checkpoint, ctx.target_entry
        if draft.weights_sha256 == ctx.target.weights_sha256 and cfg.draft_quant == cfg.quant and ctx.vocab is None:
            ctx.say("draft is the target: reusing its engine")
            shutil.copytree(ctx.stage / "target", out / "draft", copy_function=_link_or_copy)
            engine = target_entry.engine.model_copy(update={"path": "draft"})
            return ModelDraft.of(target_entry, source=draft.source, engine=engine)
        graph, why_not_genai = ctx.draft_graph(cfg, inspect_checkpoint(draft.path), target_entry.engine.graph)
        if why_not_genai:
            ctx.say(f"exporting the draft with optimum, not the target's builder graph ({why_not_genai}): it drafts row by row")
        entry = ctx.export(draft, out / "draft", cfg, cfg.draft_quant, ctx.tokenizer, ctx.say, ctx.timings,
                                      "draft", ctx.vocab, graph)
        return ModelDraft.of(entry)

    @classmethod
    def describe(cls, entry):
        lines = [f"{entry.source}: max |logit diff| vs torch {entry.export_check.max_abs_diff:.2e}"]
        if entry.vocab is not None:
            lines.append(f"head scores its {entry.vocab.size} most used tokens ({entry.vocab.coverage:.1%} of its training tokens)")
        return lines


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
