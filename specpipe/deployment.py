"""Open a built deployment (engines/<name>/): manifest, tokenizer, target engine, drafter, generator."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from specpipe.config import THREADS
from specpipe.contract.costs import StepCosts
from specpipe.contract.decoding import DecodingPolicy
from specpipe.contract.generation import GenerationConfig
from specpipe.contract.manifest import Manifest
from specpipe.drafts import make_drafter, read_manifest
from specpipe.drafts.eagle3 import head_drafter
from specpipe.engines import Engine, load_engine
from specpipe.engines.timing import head_step_ms, step_ms, target_step
from specpipe.errors import EngineError
from specpipe.speculative.batching import BatchScheduler
from specpipe.speculative.drafters import Drafter
from specpipe.speculative.generator import SpecGenerator


@dataclass
class Deployment:
    folder: Path
    manifest: Manifest
    tokenizer: object
    target: Engine
    drafter: Optional[Drafter]
    generator: SpecGenerator
    threads: int = THREADS  # the engines' intra-op threads, as loaded

    @property
    def costs(self) -> StepCosts:
        """What adaptive K assumes a draft step and a verified token cost (measured at build)."""
        return self.generator.decoder.costs

    @property
    def decoding(self) -> DecodingPolicy:
        """K as built (max_draft_len, the batch schedule); its `request` turns a requested K into a request's config."""
        return self.manifest.decoding

    @property
    def max_draft_len(self) -> int:
        return self.manifest.max_draft_len

    def generation_config(self, **overrides) -> GenerationConfig:
        """A request on this deployment as deployed: `overrides`, K within the build's (DecodingPolicy.request)."""
        return self.decoding.request(None, **overrides)

    def target_alone(self, threads: Optional[int] = None) -> SpecGenerator:
        """The target alone as a build without a draft deploys it: unpadded (builder/measure.py `rows_per_call`).
        The speed any draft must beat. When this deployment's target pads its 1-token calls to verify rows
        (engines/onnxruntime.py `min_rows`), that is a second session on the same files; otherwise its own generator.
        Its greedy ids may differ from the padded target's by a kernel's rounding: a speculative row's output is
        compared with the padded target alone, which it must equal."""
        if self.target.min_rows == 1:
            return self.generator
        engine = load_engine(self.folder / self.manifest.target.engine.path, threads=threads or self.threads, min_rows=1)
        return SpecGenerator(engine, None, self.tokenizer, self.manifest.eos_token_ids, self.generator.decoder.costs)


def make_scheduler(target: Engine, drafter: Optional[Drafter], eos_token_ids, costs: Optional[StepCosts],
                   manifest: Manifest) -> BatchScheduler:
    """The continuous-batching scheduler with the build's limits, schedule and measured batch costs."""
    serving = manifest.serving
    return BatchScheduler(
        target, drafter, eos_token_ids, costs,
        max_batch_size=serving.max_batch_size, max_queue=serving.max_queue, batch_costs=manifest.batch_costs,
        draft_schedule=manifest.decoding.schedule_rows(),
        prior_acceptance=manifest.draft_acceptance(), draft_batch_costs=manifest.draft_batch_costs,
    )


def target_rows_per_call(target, *, verifies: bool) -> int:
    """Rows per call of the target (a manifest's TargetEntry) as the build recorded them, so a 1-token step scores like
    a verify row (engines/onnxruntime.py). A target built without a draft runs unpadded (builder/measure.py
    `rows_per_call`); `verifies`: a head drafts for it after all (`--draft HEAD`), so it pads as the build measured
    it must (the record keeps verify_calls false and the unpadded difference)."""
    from specpipe.engines.onnxruntime import TARGET_MIN_ROWS

    consistency = target.verify_consistency
    if verifies and consistency is not None and not consistency.verify_calls:
        return TARGET_MIN_ROWS
    return target.min_rows_per_call


def load_deployment(folder: str | Path, *, threads: int = THREADS, batching: bool = False,
                    max_batch_size: Optional[int] = None, max_queue: Optional[int] = None,
                    head: Optional[Path] = None, spinning: bool = True) -> Deployment:
    """`batching`: requests decode together (speculative/batching.py) up to the build's max_batch_size (or
    `max_batch_size`, with `max_queue`, when given: the Triton model's parameters); the served model asks for
    it. Otherwise each generation decodes alone (generate, bench, gate in process).
    `head`: an EAGLE-3 head folder that drafts instead of the manifest's draft (`generate`/`bench --draft`).
    `spinning` False: the target's worker threads block rather than spin while waiting (the served model sets it)."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest.target.engine.backend == "trtllm":
        from specpipe.contract.manifest import SERVED_BY

        raise EngineError(f"{folder} is a TensorRT-LLM build: it runs only in TensorRT-LLM ({SERVED_BY})")
    tokenizer = AutoTokenizer.from_pretrained(str(folder / manifest.tokenizer.path))
    target = load_engine(folder / manifest.target.engine.path, threads=threads,
                         min_rows=target_rows_per_call(manifest.target, verifies=head is not None), spinning=spinning)
    step_costs = manifest.step_costs
    if head is not None:
        drafter = head_drafter(Path(head), target, folder / manifest.target.engine.path, dtype="measure")
        # no build timed this head against this target: its step cost is timed here, as the build would
        step_costs = (dataclasses.replace(step_costs, draft=head_step_ms(drafter.head, between=target_step(target))
                                          / step_ms(target, 1))
                      if step_costs else None)
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
    return Deployment(folder, manifest, tokenizer, target, drafter, generator, threads)
