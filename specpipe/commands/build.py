"""`specpipe build`."""

from __future__ import annotations

import json
from pathlib import Path

import click

from specpipe.commands.gpu_build import backend_of, gpu_build, gpu_options, split_gpu_options
from specpipe.config import BuildConfig, NgramConfig, field_default, field_help, make_config


@click.command()
@gpu_options
@click.option("--target", required=True, help="Target: HF checkpoint folder, .gguf file, or alias (e.g. smollm2-135m).")
@click.option("--draft", required=True,
              help="Draft: same forms as --target, sharing its tokenizer; or `ngram` (prompt lookup, no model); or "
                   "`self:int4-wo` / `self:int8-wo` (the target's own weight-only quantized engine).")
@click.option("--ngram-max", type=int, default=field_default(NgramConfig, "ngram_max"), show_default=True,
              help="--draft ngram: " + field_help(NgramConfig, "ngram_max"))
@click.option("--ngram-min", type=int, default=field_default(NgramConfig, "ngram_min"), show_default=True,
              help="--draft ngram: " + field_help(NgramConfig, "ngram_min"))
@click.option("--name", default=None, help="Output name under --engines-dir. [default: TARGET--DRAFT]")
@click.option("--engines-dir", type=click.Path(path_type=Path), default=field_default(BuildConfig, "engines_dir"), show_default=True)
@click.option("--repo-dir", type=click.Path(path_type=Path), default=field_default(BuildConfig, "repo_dir"), show_default=True,
              help="Triton model repository to write.")
@click.option("--no-repo", is_flag=True, help="Do not write the Triton model repository.")
@click.option("--triton-instances", type=int, default=field_default(BuildConfig, "triton_instances"), show_default=True,
              help=field_help(BuildConfig, "triton_instances"))
@click.option("--max-draft-len", type=int, default=field_default(BuildConfig, "max_draft_len"), show_default=True,
              help=field_help(BuildConfig, "max_draft_len"))
@click.option("--threads", type=int, default=field_default(BuildConfig, "threads"), show_default=True,
              help=field_help(BuildConfig, "threads"))
@click.option("--export-tolerance", type=float, default=field_default(BuildConfig, "export_tolerance"), show_default=True,
              help=field_help(BuildConfig, "export_tolerance"))
@click.option("--allow-pickle", is_flag=True, help="Allow pickle (.bin) weights. Only for checkpoints you trust.")
@click.option("--force", is_flag=True, help="Replace an existing build of the same name.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON when done.")
def build(as_json: bool, no_repo: bool, **options) -> None:
    """Check a draft/target pair, export both to engines, and write engines/NAME/manifest.json.

    \b
    Example:
      specpipe build --target smollm2-135m --draft path/to/draft
    """
    from rich.console import Console

    from specpipe.build import build as build_pair

    if no_repo:
        options["repo_dir"] = None
    ngram = make_config(NgramConfig, ngram_max=options.pop("ngram_max"), ngram_min=options.pop("ngram_min"))
    gpu = split_gpu_options(build, options)
    if backend_of(gpu) is not None:  # --backend tensorrt | trtllm: specpipe/commands/gpu_build.py
        return gpu_build(gpu, options, as_json=as_json)
    cfg = make_config(BuildConfig, **options, ngram=ngram)
    console = Console(stderr=True)
    with console.status("building") as status:
        folder = build_pair(cfg, progress=lambda msg: (status.update(msg), console.log(msg)))
    manifest = json.loads((folder / "manifest.json").read_text())
    if as_json:
        click.echo(json.dumps(manifest, indent=2))
    else:
        t, d = manifest["target"], manifest["draft"]
        click.echo(f"built {folder}")
        click.echo(f"  target {t['source']}: max |logit diff| vs torch {t['export_check']['max_abs_diff']:.2e}")
        if "export_check" in d:
            click.echo(f"  draft  {d['source']}: max |logit diff| vs torch {d['export_check']['max_abs_diff']:.2e}")
        elif d["kind"] == "self":
            click.echo(f"  draft  {d['source']}: top-1 agreement with the target "
                       f"{d['quant']['accuracy']['top1_agreement']:.3f}")
        else:
            click.echo(f"  draft  prompt lookup (n-grams {d['ngram']['ngram_min']}..{d['ngram']['ngram_max']})")
        click.echo(f"  took {manifest['timings_s']['total_s']:.1f} s")
