"""`specpipe build`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from specpipe.commands.gpu_build import backend_of, gpu_build, gpu_options, split_gpu_options
from specpipe.config import (AccuracyBudget, BuildConfig, DraftChoiceConfig, NgramConfig, QuantConfig, field_choices,
                             field_default, field_help, make_config)
from specpipe.errors import UsageError
from specpipe.quantize.pipeline import MODE_HELP

if TYPE_CHECKING:
    from specpipe.manifest import Manifest

_QUANT_MODES = click.Choice(field_choices(QuantConfig, "mode"))


@click.command()
@gpu_options
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
@click.option("--kv-cache-dtype", type=click.Choice(field_choices(QuantConfig, "kv_cache_dtype")),
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
@click.option("--max-draft-len", type=int, default=field_default(BuildConfig, "max_draft_len"), show_default=True,
              help=field_help(BuildConfig, "max_draft_len"))
@click.option("--draft-vocab", type=int, default=None, metavar="N", help=field_help(BuildConfig, "draft_vocab"))
@click.option("--threads", type=int, default=field_default(BuildConfig, "threads"), show_default=True,
              help=field_help(BuildConfig, "threads"))
@click.option("--export-tolerance", type=float, default=field_default(BuildConfig, "export_tolerance"), show_default=True,
              help=field_help(BuildConfig, "export_tolerance"))
@click.option("--allow-pickle", is_flag=True, help="Allow pickle (.bin) weights. Only for checkpoints you trust.")
@click.option("--force", is_flag=True, help="Replace an existing build of the same name.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON when done.")
def build(as_json: bool, no_repo: bool, **options) -> None:
    """Check a draft/target pair, export both to engines, and write engines/NAME/manifest.json.

    With several --draft candidates, deploy the one measured fastest, or the target alone.

    \b
    Examples:
      specpipe build --target smollm2-135m --draft path/to/draft
      specpipe build --target smollm2-135m --draft path/to/draft --draft ngram --draft self:int4-wo
    """
    from rich.console import Console

    from specpipe.build import build as build_pair
    from specpipe.manifest import read_manifest

    if no_repo:
        options["repo_dir"] = None
    ngram = make_config(NgramConfig, ngram_max=options.pop("ngram_max"), ngram_min=options.pop("ngram_min"))
    choice = make_config(DraftChoiceConfig, **{k: options.pop(k) for k in ("min_speedup", "choice_prompts", "choice_tokens")})
    options["draft"] = list(options["draft"])
    gpu = split_gpu_options(build, options)
    if backend_of(gpu) is not None:  # --backend tensorrt | trtllm: specpipe/commands/gpu_build.py
        if len(options["draft"]) != 1:
            raise UsageError(f"--backend {backend_of(gpu)} builds one --draft; got {len(options['draft'])}")
        return gpu_build(gpu, {**options, "draft": options["draft"][0]}, as_json=as_json)
    quant, draft_quant = _quant_configs(options)
    cfg = make_config(BuildConfig, **options, ngram=ngram, choice=choice, quant=quant, draft_quant=draft_quant)
    console = Console(stderr=True)
    with console.status("building") as status:
        folder = build_pair(cfg, progress=lambda msg: (status.update(msg), console.log(msg)))
    manifest = read_manifest(folder)
    if as_json:
        click.echo(json.dumps(manifest.as_dict(), indent=2))
    else:
        _print_summary(folder, manifest)
    for warning in manifest.warnings:
        click.echo(f"warning: {warning}", err=True)


def _print_summary(folder: Path, manifest: Manifest) -> None:
    t, d = manifest.target, manifest.draft
    click.echo(f"built {folder}")
    click.echo(f"  target {t.source}: max |logit diff| vs torch {t.export_check.max_abs_diff:.2e}")
    if d.kind == "model":
        click.echo(f"  draft  {d.source}: max |logit diff| vs torch {d.export_check.max_abs_diff:.2e}")
        if d.vocab is not None:
            click.echo(f"  draft  head scores its {d.vocab.size} most used tokens ({d.vocab.coverage:.1%} of its training tokens)")
    elif d.kind == "self":
        click.echo(f"  draft  {d.source}: top-1 agreement with the target {d.quant.accuracy.top1_agreement:.3f}")
    elif d.kind == "ngram":
        click.echo(f"  draft  prompt lookup (n-grams {d.ngram.ngram_min}..{d.ngram.ngram_max})")
    else:
        click.echo("  draft  none: the target alone decodes every request")
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
