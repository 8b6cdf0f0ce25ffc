"""`specpipe distill`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_args

import click
from click.core import ParameterSource

from specpipe.config import field_choices, field_default, field_help, make_config
from specpipe.distill.config import DistillConfig, VerdictQuant
from specpipe.errors import UsageError


def _option(name: str, **kwargs):
    """A click option whose default and help come from DistillConfig."""
    field = name.lstrip("-").replace("-", "_")
    return click.option(name, default=field_default(DistillConfig, field), show_default=True,
                        help=field_help(DistillConfig, field), **kwargs)


@click.command()
@click.option("--target", required=True, help="Target: HF checkpoint folder, .gguf file, or alias (e.g. smollm2-135m).")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Folder to write the draft checkpoint to.")
@_option("--layers", type=int)
@_option("--width", type=int)
@_option("--minutes", type=float)
@_option("--answer-tokens", type=int)
@_option("--train-tokens", type=int)
@_option("--data-fraction", type=float)
@_option("--seed", type=int)
@click.option("--data", multiple=True, type=click.Choice(field_choices(DistillConfig, "data")),
              default=field_default(DistillConfig, "data"), show_default=True, help=field_help(DistillConfig, "data"))
@click.option("--prompts", type=click.Path(path_type=Path), default=None, help=field_help(DistillConfig, "prompts"))
@_option("--max-answer-tokens", type=int)
@_option("--answer-batch", type=int)
@_option("--teacher-engine", type=click.Choice(field_choices(DistillConfig, "teacher_engine")))
@_option("--teacher-dtype", type=click.Choice(field_choices(DistillConfig, "teacher_dtype")))
@_option("--train-dtype", type=click.Choice(field_choices(DistillConfig, "train_dtype")))
@_option("--device", type=click.Choice(field_choices(DistillConfig, "device")))
@_option("--lr", type=float)
@_option("--batch-tokens", type=int)
@_option("--prompt-weight", type=float)
@_option("--negatives", type=int)
@_option("--checkpoint-every", type=int)
@_option("--threads", type=int)
@_option("--kind", type=click.Choice(field_choices(DistillConfig, "kind")))
@click.option("--feature-layers", default=None, help=field_help(DistillConfig, "feature_layers") + " (comma-separated)")
@_option("--head-vocab", type=int)
@_option("--ttt-steps", type=int)
@_option("--ttt-decay", type=float)
@click.option("--warm-start/--no-warm-start", default=field_default(DistillConfig, "warm_start"), show_default=True,
              help=field_help(DistillConfig, "warm_start"))
@click.option("--warm-attention/--no-warm-attention", default=field_default(DistillConfig, "warm_attention"),
              show_default=True, help=field_help(DistillConfig, "warm_attention"))
@click.option("--verdict-quant", multiple=True, type=click.Choice(get_args(VerdictQuant)),
              default=field_default(DistillConfig, "verdict_quant"), show_default=True,
              help=field_help(DistillConfig, "verdict_quant") + " (repeatable)")
@click.option("--verdict/--no-verdict", default=field_default(DistillConfig, "verdict"), show_default=True,
              help=field_help(DistillConfig, "verdict"))
@click.option("--init-head", type=click.Path(path_type=Path), default=None, help=field_help(DistillConfig, "init_head"))
@click.option("--resume", is_flag=True, help=field_help(DistillConfig, "resume"))
@click.option("--force", is_flag=True, help=field_help(DistillConfig, "force"))
@click.option("--json", "as_json", is_flag=True, help="Print the distillation record as JSON when done.")
def distill(as_json: bool, data, **options) -> None:
    """Train a small draft for TARGET on CPU by distillation from the target's own answers.

    The draft shares the target's tokenizer and is written to OUT as a normal Hugging Face checkpoint,
    ready for `specpipe build --target TARGET --draft OUT`. Target answers are cached, so a second run
    spends its whole budget training.

    \b
    Budgets: --minutes alone spends that much time (a faster machine gets a better draft);
    --answer-tokens and --train-tokens fix the work instead (the same draft on any machine), with
    --minutes as a cap. Precision (--teacher-dtype, --train-dtype) is chosen by timing fp32 and
    bf16 on this machine for about a second each, unless given; so is the teacher (--teacher-engine):
    the target in torch, or as the ONNX Runtime engine build deploys, at each --verdict-quant precision.

    \b
    Example:
      specpipe distill --target smollm2-135m --out drafts/smollm2-draft --minutes 12
      specpipe distill --target smollm2-135m --out D --answer-tokens 40000 --train-tokens 400000 --minutes 30
    """
    from specpipe.distill import RichDistillProgress
    from specpipe.distill import distill as run_distill
    from specpipe.distill.precision import PrecisionChoice
    from specpipe.distill.verdict import verdict_line

    given = click.get_current_context().get_parameter_source("warm_attention") != ParameterSource.DEFAULT
    if given and options["warm_attention"] and not options["warm_start"]:
        raise UsageError("--warm-attention needs --warm-start (the copied attention reads the warm start's fc and norms)")
    layers = options.pop("feature_layers")
    options["verdict_quant"] = list(options["verdict_quant"])
    cfg = make_config(DistillConfig, data=list(data), **options,
                      feature_layers=[int(i) for i in layers.split(",")] if layers else None)
    progress = RichDistillProgress()
    try:
        result = run_distill(cfg, progress)
    finally:
        progress.close()
    record = result.record
    if as_json:
        click.echo(json.dumps(record, indent=2))
        return
    draft, data_info, training = record["draft"], record["data"], record["training"]
    click.echo(f"wrote {result.path}")
    click.echo(f"  draft: {draft['layers']} layers, width {draft['width']}, {draft['parameters'] / 1e6:.1f}M parameters, "
               f"{draft['weights_read_per_token_vs_target']:.3f}x the target's weights read per token")
    click.echo(f"  data: {data_info['sequences']} sequences, {data_info['answer_tokens']:,} answer tokens")
    click.echo(f"  training: {training['steps']} steps, {training['epochs']} epochs, loss {training['final_loss']}")
    if (record.get("split") or {}).get("advice"):
        click.echo(f"  {record['split']['advice']}")
    for choice in record["precision"].values():
        click.echo(f"  precision {PrecisionChoice(**choice).describe()} on {record['device']}")
    if record["held_out_agreement"] is not None:
        click.echo(f"  agreement with the target's greedy answers on held-out prompts: {record['held_out_agreement']:.3f}")
    if record.get("held_out_agreement_by_step"):
        click.echo("  by drafted position (EAGLE-3 head, given the earlier ones accepted): "
                   + ", ".join(f"{a:.3f}" for a in record["held_out_agreement_by_step"]))
    if record.get("verdict"):
        click.echo(f"  {verdict_line(record['verdict'])}")
