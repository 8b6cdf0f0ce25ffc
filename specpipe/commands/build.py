"""`specpipe build`."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import click
from click.core import ParameterSource

from specpipe.builder.config import BACKENDS, BuildConfig, DraftChoiceConfig, OnnxRuntimeBackend, TrtllmBackend
from specpipe.config import field_choices, field_default, field_help, make_config
from specpipe.contract.drafts import NgramConfig
from specpipe.contract.quant import AccuracyBudget, QuantConfig
from specpipe.quantize.pipeline import MODE_HELP

if TYPE_CHECKING:
    from specpipe.contract.manifest import Manifest

def _choice(model, field: str) -> click.Choice:
    return click.Choice(field_choices(model, field))


_QUANT_MODES = _choice(QuantConfig, "mode")


# The options of the backends' own configs (BuildConfig.backend): --backend picks the config, and an option is
# passed on only when given, so one that another backend takes is refused, never ignored. TrtllmBackend holds
# every GPU option (TensorRTBackend takes the ones they share).
_BACKEND_OPTIONS: dict[str, tuple[type, dict]] = {
    "threads": (OnnxRuntimeBackend, dict(type=int)),
    "export_tolerance": (OnnxRuntimeBackend, dict(type=float)),
    "max_batch_size": (OnnxRuntimeBackend, dict(type=int)),  # the GPU backends default to 8
    "max_queue": (OnnxRuntimeBackend, dict(type=int)),
    "draft_schedule": (OnnxRuntimeBackend, dict(metavar="B:K,...")),
    "target_graph": (OnnxRuntimeBackend, dict(type=_choice(OnnxRuntimeBackend, "target_graph"))),
    "trtllm_flow": (TrtllmBackend, dict(type=_choice(TrtllmBackend, "trtllm_flow"))),
    "tp_size": (TrtllmBackend, dict(type=int)),
    "draft_tp_size": (TrtllmBackend, dict(type=int)),
    "draft_placement": (TrtllmBackend, dict(type=_choice(TrtllmBackend, "draft_placement"))),
    "gpu_memory_gb": (TrtllmBackend, dict(type=float)),
    "max_input_len": (TrtllmBackend, dict(type=int)),
    "max_seq_len": (TrtllmBackend, dict(type=int)),
    "dtype": (TrtllmBackend, dict(type=_choice(TrtllmBackend, "dtype"))),
    "trtllm_checkout": (TrtllmBackend, dict(type=click.Path(path_type=Path))),
    "modelopt_checkout": (TrtllmBackend, dict(type=click.Path(path_type=Path))),
    "dry_run": (TrtllmBackend, dict(is_flag=True)),
}


def _backend_options(command):
    """--backend and the options of its config, defaults and help from the config models."""
    for field, (model, kwargs) in reversed(_BACKEND_OPTIONS.items()):
        default = field_default(model, field)
        shown = {} if kwargs.get("is_flag") else {"show_default": default is not None}
        command = click.option("--" + field.replace("_", "-"), default=default, help=field_help(model, field), **shown,
                               **kwargs)(command)
    return click.option("--backend", type=click.Choice(list(BACKENDS)), default=field_default(BuildConfig, "backend").kind,
                        show_default=True, help=field_help(BuildConfig, "backend") + ".")(command)


@click.command()
@click.option("--target", required=True, help="Target: HF checkpoint folder, .gguf file, or alias (e.g. smollm2-135m).")
@click.option("--draft", required=True, multiple=True,
              help="Draft: same forms as --target, sharing its tokenizer; or `ngram` (prompt lookup, no model); or "
                   "`self:int4-wo` / `self:int8-wo` (the target's own weight-only quantized engine); or `none` (the "
                   "target alone). Repeat it to give candidates: each is built and measured against the target alone "
                   "on a few bench prompts, and the fastest is deployed, or none unless one reaches --min-speedup.")
@click.option("--min-speedup", type=float, default=field_default(DraftChoiceConfig, "min_speedup"), show_default=True,
              help="Several --draft: " + field_help(DraftChoiceConfig, "min_speedup"))
@click.option("--choice-prompts", type=int, default=field_default(DraftChoiceConfig, "choice_prompts"), show_default=True,
              help="Several --draft: bench prompts measured from each of the "
                   + " and ".join(field_default(DraftChoiceConfig, "choice_sets")) + " sets.")
@click.option("--choice-tokens", type=int, default=field_default(DraftChoiceConfig, "choice_tokens"), show_default=True,
              help="Several --draft: " + field_help(DraftChoiceConfig, "choice_tokens"))
@click.option("--ngram-max", type=int, default=field_default(NgramConfig, "ngram_max"), show_default=True,
              help="--draft ngram: " + field_help(NgramConfig, "ngram_max"))
@click.option("--ngram-min", type=int, default=field_default(NgramConfig, "ngram_min"), show_default=True,
              help="--draft ngram: " + field_help(NgramConfig, "ngram_min"))
@click.option("--quant", type=_QUANT_MODES, default=field_default(QuantConfig, "mode"), show_default=True,
              help="Target quantization: " + MODE_HELP)
@click.option("--draft-quant", type=_QUANT_MODES, default=field_default(QuantConfig, "mode"), show_default=True,
              help="Draft model quantization (same modes; never changes the output, only acceptance).")
@click.option("--group-size", type=int, default=field_default(QuantConfig, "group_size"), show_default=True,
              help=field_help(QuantConfig, "group_size"))
@click.option("--calib-prompts", type=click.Path(path_type=Path), default=None, help=field_help(QuantConfig, "calib_prompts"))
@click.option("--calib-size", type=int, default=field_default(QuantConfig, "calib_size"), show_default=True,
              help=field_help(QuantConfig, "calib_size"))
@click.option("--smooth-quant", is_flag=True, help=field_help(QuantConfig, "smooth_quant"))
@click.option("--kv-cache-dtype", type=_choice(QuantConfig, "kv_cache_dtype"),
              default=field_default(QuantConfig, "kv_cache_dtype"), show_default=True,
              help="KV cache precision. onnxruntime: auto only; fp8/int8 need --backend tensorrt or trtllm.")
@click.option("--max-ppl-increase", type=float, default=field_default(AccuracyBudget, "max_ppl_increase"), show_default=True,
              help="Budget: " + field_help(AccuracyBudget, "max_ppl_increase"))
@click.option("--min-top1-agreement", type=float, default=field_default(AccuracyBudget, "min_top1_agreement"),
              show_default=True, help="Budget: " + field_help(AccuracyBudget, "min_top1_agreement"))
@click.option("--max-mean-kl", type=float, default=None, help="Budget: " + field_help(AccuracyBudget, "max_mean_kl"))
@click.option("--accept-accuracy-loss", is_flag=True, help="Keep a quantized engine that is over its accuracy budget.")
@click.option("--name", default=None, help="Output name under --engines-dir. [default: TARGET--DRAFT]")
@click.option("--engines-dir", type=click.Path(path_type=Path), default=field_default(BuildConfig, "engines_dir"), show_default=True)
@click.option("--repo-dir", type=click.Path(path_type=Path), default=field_default(BuildConfig, "repo_dir"), show_default=True,
              help="Triton model repository to write.")
@click.option("--no-repo", is_flag=True, help="Do not write the Triton model repository.")
@click.option("--triton-instances", type=int, default=field_default(BuildConfig, "triton_instances"), show_default=True,
              help=field_help(BuildConfig, "triton_instances"))
@click.option("--stream-interval", type=int, default=field_default(BuildConfig, "stream_interval"), show_default=True,
              metavar="TOKENS", help=field_help(BuildConfig, "stream_interval"))
@click.option("--max-draft-len", type=int, default=field_default(BuildConfig, "max_draft_len"), show_default=True,
              help=field_help(BuildConfig, "max_draft_len"))
@click.option("--draft-vocab", type=int, default=None, metavar="N", help=field_help(BuildConfig, "draft_vocab"))
@click.option("--allow-pickle", is_flag=True, help="Allow pickle (.bin) weights. Only for checkpoints you trust.")
@click.option("--force", is_flag=True, help="Replace an existing build of the same name.")
@_backend_options
@click.option("--json", "as_json", is_flag=True, help="Print the manifest (GPU backends: the plan) as JSON when done.")
def build(as_json: bool, no_repo: bool, backend: str, **options) -> None:
    """Check a draft/target pair, export both to engines, and write engines/NAME/manifest.json.

    With several --draft candidates, deploy the one measured fastest, or the target alone.

    \b
    Examples:
      specpipe build --target smollm2-135m --draft path/to/draft
      specpipe build --target smollm2-135m --draft path/to/draft --draft ngram --draft self:int4-wo
    """
    from specpipe.builder import build as build_pair
    from specpipe.drafts import read_manifest

    cfg = _config(backend, no_repo, options)
    if cfg.backend.kind != "onnxruntime":
        return _gpu_build(cfg, as_json)
    with _status() as say:
        folder = build_pair(cfg, progress=say)
    manifest = read_manifest(folder)
    if as_json:
        click.echo(json.dumps(manifest.as_dict(), indent=2))
    else:
        _print_summary(folder, manifest)
    for warning in manifest.warnings:
        click.echo(f"warning: {warning}", err=True)


def _gpu_build(cfg: BuildConfig, as_json: bool) -> None:
    """Plan; print it and write the repository (--dry-run), or run it where CUDA and the packages are."""
    from specpipe.builder import make_plan, render_plan, run_plan, write_plan_repository

    plan = make_plan(cfg)
    if cfg.backend.dry_run:
        written = write_plan_repository(plan, cfg)
        click.echo(plan.model_dump_json(indent=2) if as_json else render_plan(plan))
        if written and not as_json:
            click.echo(f"\nwrote the Triton repository: {plan.repo_dir} ({len(written)} files; upstream model.py files are"
                       " copied by the real build)")
        return
    with _status() as say:
        folder = run_plan(plan, cfg, progress=say)
    click.echo(plan.model_dump_json(indent=2) if as_json else f"built {folder} ({plan.backend}, {plan.flow})")


@contextmanager
def _status():
    """Progress on stderr: the current step, and a log line per step."""
    from rich.console import Console

    console = Console(stderr=True)
    with console.status("building") as status:
        yield lambda msg: (status.update(msg), console.log(msg))


def _config(backend: str, no_repo: bool, options: dict) -> BuildConfig:
    """The BuildConfig of the command line: the backend's options only where given (parameter source)."""
    context = click.get_current_context()
    given = {field: options.pop(field) for field in _BACKEND_OPTIONS}
    given = {field: value for field, value in given.items() if context.get_parameter_source(field) != ParameterSource.DEFAULT}
    ngram = make_config(NgramConfig, ngram_max=options.pop("ngram_max"), ngram_min=options.pop("ngram_min"))
    choice = make_config(DraftChoiceConfig, **{k: options.pop(k) for k in ("min_speedup", "choice_prompts", "choice_tokens")})
    quant, draft_quant = _quant_configs(options)
    if no_repo:
        options["repo_dir"] = None
    return make_config(BuildConfig, **options, backend={"kind": backend, **given},
                       ngram=ngram, choice=choice, quant=quant, draft_quant=draft_quant)


def _print_summary(folder: Path, manifest: Manifest) -> None:
    t, d = manifest.target, manifest.draft
    click.echo(f"built {folder}")
    click.echo(f"  target {t.source}: max |logit diff| vs torch {t.export_check.max_abs_diff:.2e}")
    if t.quant is not None and t.quant.candidates:
        click.echo(f"  target --quant auto kept {'fp32' if t.quant.mode == 'none' else t.quant.mode}; every precision measured:")
        for candidate in t.quant.candidates:
            click.echo(f"   {'*' if candidate.mode == t.quant.mode else ' '} {candidate.summary(t.quant.load_rows)}")
        if t.quant.reason:
            click.echo(f"  target precision: {t.quant.reason}")
    from specpipe.drafts import kind_named

    for line in kind_named(d.kind).describe(d):
        click.echo(f"  draft  {line}")
    prediction = getattr(d, "prediction", None)
    if prediction is not None:
        click.echo(f"  draft  predicted {prediction.speedup:.2f}x the target alone (acceptance {prediction.acceptance:.2f}, "
                   f"{prediction.acceptance_from})")
    choice = manifest.draft_choice
    if choice:
        click.echo(f"  candidates, greedy with adaptive K on {choice.candidates[0].prompts} bench prompts "
                   f"({' + '.join(choice.sample.prompt_sets)}), {choice.sample.new_tokens} new tokens each:")
        for m in choice.candidates:
            accepted = "" if m.acceptance_rate is None else f"  acceptance {m.acceptance_rate:.2f}"
            predicted = "" if m.predicted_speedup is None else f"  predicted {m.predicted_speedup:.2f}x"
            mark = "*" if m.draft == choice.chosen else " "
            click.echo(f"   {mark} {m.draft:<28} {m.tokens_per_s:7.1f} tok/s  {m.speedup:.2f}x{accepted}{predicted}")
        click.echo(f"  deployed {choice.chosen}: {choice.reason}")
    click.echo(f"  took {manifest.timings_s['total_s']:.1f} s")


def _quant_configs(options: dict) -> tuple[QuantConfig, QuantConfig]:
    """Pop the quantization options; target and draft share everything but the mode."""
    budget = make_config(AccuracyBudget, **{k: options.pop(k) for k in ("max_ppl_increase", "min_top1_agreement", "max_mean_kl")})
    shared = {k: options.pop(k) for k in ("group_size", "calib_prompts", "calib_size", "smooth_quant", "kv_cache_dtype",
                                          "accept_accuracy_loss")}
    mode, draft_mode = options.pop("quant"), options.pop("draft_quant")
    return (make_config(QuantConfig, mode=mode, budget=budget, **shared),
            make_config(QuantConfig, mode=draft_mode, budget=budget, **shared))
