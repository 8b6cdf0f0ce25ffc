"""Open a built deployment (engines/<name>/): manifest, tokenizer, target engine, drafter, generator."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from specpipe.config import THREADS
from specpipe.contract.costs import StepCosts
from specpipe.contract.drafts import parse_draft_schedule
from specpipe.contract.generation import GenerationConfig
from specpipe.contract.manifest import DraftEntry, Manifest, read_manifest
from specpipe.engines import Engine, load_engine
from specpipe.errors import EngineError, UsageError
from specpipe.speculative.batching import BatchScheduler
from specpipe.speculative.drafters import Drafter, ModelDrafter
from specpipe.speculative.eagle3 import DEFAULT_HEAD_DRAFT_COST, Eagle3Drafter
from specpipe.speculative.generator import SpecGenerator
from specpipe.speculative.ngram import NgramDrafter


@dataclass
class Deployment:
    folder: Path
    manifest: Manifest
    tokenizer: object
    target: Engine
    drafter: Optional[Drafter]
    generator: SpecGenerator

    @property
    def costs(self) -> StepCosts:
        """What adaptive K assumes a draft step and a verified token cost (measured at build)."""
        return self.generator.decoder.costs

    @property
    def max_draft_len(self) -> int:
        return self.manifest.max_draft_len

    def generation_config(self, **overrides) -> GenerationConfig:
        return bounded_generation_config(self.max_draft_len, **overrides)


def bounded_generation_config(max_draft_len: int, **overrides) -> GenerationConfig:
    """A GenerationConfig for a deployment built for K <= max_draft_len: a fixed K beyond it is refused, an
    adaptive K is kept within it."""
    cfg = GenerationConfig(**overrides)
    if cfg.draft_length != "fixed":
        ceiling = min(cfg.max_draft_tokens, max_draft_len)
        return cfg.model_copy(update={"max_draft_tokens": ceiling, "num_draft_tokens": min(cfg.num_draft_tokens, ceiling)})
    if cfg.num_draft_tokens > max_draft_len:
        raise EngineError(f"num_draft_tokens {cfg.num_draft_tokens} > max_draft_len {max_draft_len} this deployment was built for")
    return cfg


def make_drafter(folder: Path, draft: DraftEntry, target: Engine, threads: int) -> Optional[Drafter]:
    """The drafter the manifest's `draft` section describes: kind model, self (the target quantized: a
    model draft too), eagle3 (a head drafting from the target's features), ngram (prompt lookup, no engine),
    or none (the target alone: build found no draft that made decoding faster; every request then decodes
    target-only)."""
    if draft.kind == "none":
        return None
    if draft.kind == "ngram":
        return NgramDrafter.from_config(draft.ngram)
    if draft.kind == "eagle3":
        return eagle3_drafter(folder / draft.path, target, target.folder)
    return ModelDrafter(load_engine(folder / draft.engine.path, threads=threads), target.vocab_size)


def eagle3_drafter(head_folder: Path, target: Engine, target_folder: Path) -> Eagle3Drafter:
    """An EAGLE-3 head (upstream's format) drafting for `target`, whose engine must output the head's feature
    layers (export/features.py). The head reads the target's input embedding from the target's graph."""
    from specpipe.checkpoint.eagle3 import read_eagle3_head
    from specpipe.engines.eagle3_head import Eagle3HeadEngine, check_pairing, target_embedding

    info = read_eagle3_head(str(head_folder))
    if info is None:
        raise UsageError(f"--draft {head_folder} is not an EAGLE-3 head (config.json naming LlamaForCausalLMEagle3)")
    # A head that names no layers reads EAGLE-3's default ones (export/features.py), as upstream's loaders assume.
    layers = info.layers_to_capture or _default_feature_layers(target_folder)
    head = Eagle3HeadEngine(head_folder, target_embedding(target_folder), dtype="auto",  # bf16 where the CPU has it
                            feature_layers=layers)
    check_pairing(head, getattr(target, "feature_layers", ()), target.vocab_size, target_folder)
    return Eagle3Drafter(head, target.vocab_size)


def _default_feature_layers(target_folder: Path) -> tuple[int, ...]:
    from specpipe.engines.base import read_engine_meta
    from specpipe.export.features import default_layers

    try:
        return default_layers(int(read_engine_meta(target_folder)["num_layers"]))
    except ValueError as err:
        raise UsageError(f"the head names no feature layers and EAGLE-3's defaults do not fit this target: {err}") from None


def make_scheduler(target: Engine, drafter: Optional[Drafter], eos_token_ids, costs: Optional[StepCosts],
                   manifest: Manifest) -> BatchScheduler:
    """The continuous-batching scheduler with the build's limits, schedule and measured batch costs."""
    serving = manifest.serving
    return BatchScheduler(
        target, drafter, eos_token_ids, costs,
        max_batch_size=serving.max_batch_size, max_queue=serving.max_queue, batch_costs=manifest.batch_costs,
        draft_schedule=parse_draft_schedule(serving.draft_schedule) if serving.draft_schedule else None,
        prior_acceptance=manifest.draft_acceptance(), draft_batch_costs=manifest.draft_batch_costs,
    )


def load_deployment(folder: str | Path, *, threads: int = THREADS, batching: bool = False,
                    max_batch_size: Optional[int] = None, max_queue: Optional[int] = None,
                    head: Optional[Path] = None) -> Deployment:
    """`batching`: requests decode together (speculative/batching.py) up to the build's max_batch_size (or
    `max_batch_size`, with `max_queue`, when given: the Triton model's parameters); the served model asks for
    it. Otherwise each generation decodes alone (generate, bench, gate in process).
    `head`: an EAGLE-3 head folder that drafts instead of the manifest's draft (`generate`/`bench --draft`)."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest.target.engine.backend == "trtllm":
        from specpipe.contract.manifest import SERVED_BY

        raise EngineError(f"{folder} is a TensorRT-LLM build: it runs only in TensorRT-LLM ({SERVED_BY})")
    tokenizer = AutoTokenizer.from_pretrained(str(folder / manifest.tokenizer.path))
    # Builds record how the target must run for a 1-token step to score like a verify row (engines/onnxruntime.py).
    target = load_engine(folder / manifest.target.engine.path, threads=threads, min_rows=manifest.target.min_rows_per_call)
    step_costs = manifest.step_costs
    if head is not None:
        drafter = eagle3_drafter(Path(head), target, folder / manifest.target.engine.path)
        step_costs = StepCosts(DEFAULT_HEAD_DRAFT_COST, step_costs.verify_per_token) if step_costs else None
    else:
        drafter = make_drafter(folder, manifest.draft, target, threads)
    overrides = {**({"max_batch_size": max_batch_size} if max_batch_size else {}),
                 **({"max_queue": max_queue} if max_queue is not None and max_queue >= 0 else {})}
    if overrides:
        manifest = manifest.model_copy(update={"serving": manifest.serving.model_copy(update=overrides)})
    decoder = None
    if batching and manifest.serving.max_batch_size > 1:
        eos = manifest.eos_token_ids or [tokenizer.eos_token_id]
        decoder = make_scheduler(target, drafter, eos, step_costs, manifest)
    # step_costs None (built before they were measured): the drafter's defaults
    generator = SpecGenerator(target, drafter, tokenizer, manifest.eos_token_ids, step_costs, decoder=decoder)
    return Deployment(folder, manifest, tokenizer, target, drafter, generator)
