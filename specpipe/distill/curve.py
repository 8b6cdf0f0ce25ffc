"""The curve: held-out acceptance against training tokens for the model draft and the EAGLE-3 head, on the SAME
cached teacher pass (target answers with features), the same prompt split and the same machine.

    python -m specpipe.distill.curve --target smollm2-135m --answer-tokens 30000 --train-tokens 400000 \
        --plot docs/eagle3-curve.png --json curve.json

Each kind trains once over the largest budget (warm-up, then cosine over it, as `distill --train-tokens` does) and is
evaluated on the held-out answers at geometrically spaced token counts, so the whole curve costs one run per kind;
points before the last are of weights not yet annealed (a run with that budget would end a little higher).

Acceptance by drafted position: distill/acceptance.py states the conventions.
"""

from __future__ import annotations

import json
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from specpipe.distill.acceptance import ChainHits, head_chain_hits, model_chain_hits


def milestones(total_tokens: int, points: int, first: int) -> list[int]:
    """`points` token counts spaced geometrically from `first` to `total_tokens`."""
    if points <= 1 or first >= total_tokens:
        return [total_tokens]
    ratio = (total_tokens / first) ** (1 / (points - 1))
    return sorted({int(round(first * ratio**i)) for i in range(points - 1)} | {total_tokens})


@dataclass
class CurveRun:
    kind: str
    points: list[dict] = field(default_factory=list)
    train_s: float = 0.0
    label: str = ""  # what the plot and table call it; default: the kind


def train_with_curve(kind: str, trainer, evaluate: Callable[[], ChainHits], marks: list[int],
                     on_point: Callable[[dict], None] = lambda point: None) -> CurveRun:
    """Step `trainer` (train.Trainer or eagle3_train.HeadTrainer) until the last mark's tokens, evaluating at each
    mark. Training seconds exclude evaluation."""
    run = CurveRun(kind)
    trainer.budget_tokens = marks[-1]
    pending = list(marks)
    losses: list[float] = []
    while pending:
        t0 = time.perf_counter()
        loss, _, _ = trainer.step()
        run.train_s += time.perf_counter() - t0
        trainer.state.elapsed_s = run.train_s
        losses.append(loss)
        if trainer.state.tokens_seen >= pending[0]:
            while pending and trainer.state.tokens_seen >= pending[0]:
                pending.pop(0)
            point = {"kind": kind, "tokens": trainer.state.tokens_seen, "steps": trainer.state.step,
                     "train_s": round(run.train_s, 1), "loss": round(sum(losses[-10:]) / len(losses[-10:]), 4),
                     **evaluate().summary()}
            run.points.append(point)
            on_point(point)
    return run


def plot_curve(runs: list[CurveRun], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=100)
    colors = iter(["tab:blue", "tab:green", "tab:orange", "tab:red", "tab:purple"])
    for run in runs:
        color, label = next(colors, "tab:gray"), run.label or run.kind
        tokens = [p["tokens"] for p in run.points]
        for k, marker, dash in ((0, "o", "-"), (1, "s", "--"), (2, "^", ":")):
            ax.plot(tokens, [p["conditional"][k] for p in run.points], dash, marker=marker, color=color, markersize=4,
                    label=f"{label}, position {k + 1}")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("held-out acceptance (greedy, per position)")
    ax.set_ylim(0, 1)
    ax.axhline(0.7, color="gray", linewidth=0.6, linestyle="-.")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, loc="upper left", ncol=2)
    ax.set_title(textwrap.fill(title, 95), fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def table(runs: list[CurveRun]) -> str:
    lines = ["| draft | training tokens | train s | pos 1 | pos 2 | pos 3 | accepted/verify at K=3 | loss |",
             "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        for p in run.points:
            c = p["conditional"]
            lines.append(f"| {run.label or run.kind} | {p['tokens']:,} | {p['train_s']:.0f} | {c[0]:.3f} | {c[1]:.3f} | {c[2]:.3f} | "
                         f"{p['accepted_len']:.2f} | {p['loss']:.3f} |")
    return "\n".join(lines)


def run_curve(cfg, *, kinds: tuple[str, ...], points: int, first_tokens: int, model_train_tokens: Optional[int] = None,
              save_head: Optional[Path] = None, log: Callable[[str], None] = print) -> dict:
    """cfg: a DistillConfig of kind eagle3 (target, --answer-tokens, --train-tokens, the head's settings). Makes or
    reuses the teacher pass, splits it by prompt, then trains each kind in `kinds` over the same data."""
    from specpipe.checkpoint.draft_vocab import count_tokens, top_token_ids
    from specpipe.distill.config import DISTILL_KIND_DEFAULTS
    from specpipe.distill.eagle3 import head_vocab_size, load_head_weights, make_head
    from specpipe.distill.eagle3_run import _write_head, split_by_prompt
    from specpipe.distill.eagle3_train import HeadTrainer
    from specpipe.distill.precision import choose_precision
    from specpipe.distill.progress import SilentProgress
    from specpipe.distill.run import _eos_ids, _teacher_data, open_target
    from specpipe.distill.student import make_student
    from specpipe.distill.train import Trainer
    from specpipe.export.features import default_layers
    from specpipe.machine import describe_machine

    out, device, target, tokenizer, model = open_target(cfg)
    layers = tuple(cfg.feature_layers or default_layers(model.config.num_hidden_layers))
    eos_ids = _eos_ids(target.path, tokenizer)
    precision: dict = {}
    t0 = time.perf_counter()
    sequences = _teacher_data(cfg, target, model, tokenizer, eos_ids, SilentProgress(), device, precision,
                              feature_layers=layers)
    train_set, held_out = split_by_prompt(sequences)
    answer_tokens = sum(s.answer_tokens for s in train_set)
    log(f"teacher data: {len(train_set)} train answers ({answer_tokens:,} answer tokens), {len(held_out)} held out "
        f"({sum(s.answer_tokens for s in held_out):,} tokens); {time.perf_counter() - t0:.0f} s")
    runs = []
    state_dir = Path(out) / ".curve"
    for kind in kinds:
        budget = cfg.train_tokens if kind == "eagle3" else (model_train_tokens or cfg.train_tokens)
        marks = milestones(budget, points, first_tokens)
        if kind == "eagle3":
            counts = count_tokens(train_set, model.config.vocab_size)
            vocab_size = head_vocab_size(cfg.init_head, layers) if cfg.init_head is not None else cfg.head_vocab
            vocab_ids = torch.as_tensor(top_token_ids(counts, vocab_size, always=eos_ids))
            student = make_head(model, feature_layers=layers, draft_token_ids=vocab_ids, warm_start=cfg.warm_start,
                                warm_attention=cfg.starts_attention_warm, seed=cfg.seed)
            if cfg.init_head is not None:
                load_head_weights(student, cfg.init_head)
            student = student.to(device)
            trainer = HeadTrainer(student, train_set, steps=cfg.ttt_steps, decay=cfg.ttt_decay, budget_s=1e9,
                                  lr=cfg.lr, batch_tokens=cfg.batch_tokens, negatives=cfg.negatives,
                                  prompt_weight=cfg.prompt_weight, seed=cfg.seed, state_path=state_dir / "head.pt",
                                  checkpoint_every=10**9)
            evaluate = lambda: head_chain_hits(student, held_out)  # noqa: E731
        else:
            samples = [s.token_ids for s in train_set[:16]]
            student = make_student(model, layers=cfg.layers, width=cfg.width, seed=cfg.seed, samples=samples).to(device)
            defaults = DISTILL_KIND_DEFAULTS["model"]
            trainer = Trainer(student, train_set, budget_s=1e9, lr=defaults["lr"], batch_tokens=int(defaults["batch_tokens"]),
                              negatives=cfg.negatives, prompt_weight=defaults["prompt_weight"], seed=cfg.seed,
                              state_path=state_dir / "model.pt", checkpoint_every=10**9)
            evaluate = lambda: model_chain_hits(student, held_out)  # noqa: E731
        trainer.dtype = choose_precision("train", cfg.train_dtype, device, trainer.probe,
                                         options=["float32", "bfloat16"]).dtype
        log(f"{kind}: {sum(p.numel() for p in student.parameters()):,} weights, {trainer.dtype}, marks {marks}")
        if kind == "eagle3" and cfg.init_head is not None:  # where the loaded head starts, on this held-out set
            log(json.dumps({"kind": kind, "tokens": 0, "init_head": str(cfg.init_head), **evaluate().summary()}))
        run = train_with_curve(kind, trainer, evaluate, marks, on_point=lambda p: log(json.dumps(p)))
        run.label = (f"EAGLE-3 head, TTT {cfg.ttt_steps}" + (f", from {Path(cfg.init_head).name}" if cfg.init_head else "")
                     if kind == "eagle3"
                     else f"{cfg.layers}-layer model draft")
        runs.append(run)
        if kind == "eagle3" and save_head is not None:  # the last point's weights, in upstream's head format
            record = {"format": 1, "kind": "eagle3", "made_by": "specpipe.distill.curve", "target": cfg.target,
                      "config": json.loads(cfg.model_dump_json()), "held_out_chain": run.points[-1],
                      "data": {"answer_tokens": answer_tokens, "held_out_answers": len(held_out)}}
            _write_head(student.to("cpu"), Path(save_head), record)
            log(f"head written to {save_head}")
    return {"machine": describe_machine(cfg.threads).as_dict(), "machine_summary": describe_machine(cfg.threads).summary(),
            "teacher": {"train_answers": len(train_set), "answer_tokens": answer_tokens, "held_out_answers": len(held_out),
                        "held_out_tokens": sum(s.answer_tokens for s in held_out),
                        "dtype": precision["teacher"].dtype},
            "config": json.loads(cfg.model_dump_json()),
            "runs": [{"kind": r.kind, "label": r.label, "train_s": round(r.train_s, 1), "points": r.points} for r in runs]}


def main(argv: Optional[list[str]] = None) -> None:
    import click

    from specpipe.distill.config import DistillConfig
    from specpipe.errors import SpecpipeError

    @click.command(help=__doc__.split("\n\n")[0])
    @click.option("--target", default="smollm2-135m", show_default=True)
    @click.option("--answer-tokens", type=int, default=30000, show_default=True, help="teacher pass (cached)")
    @click.option("--train-tokens", type=int, default=400000, show_default=True, help="the head's largest budget")
    @click.option("--model-train-tokens", type=int, default=None, help="the model draft's (default: the head's)")
    @click.option("--points", type=int, default=6, show_default=True)
    @click.option("--first-tokens", type=int, default=10000, show_default=True)
    @click.option("--kinds", default="eagle3,model", show_default=True)
    @click.option("--minutes", type=float, default=120.0, show_default=True, help="cap on the teacher pass (its share)")
    @click.option("--plot", "plot_path", type=click.Path(path_type=Path), default=None)
    @click.option("--json", "json_path", type=click.Path(path_type=Path), default=None)
    @click.option("--work", type=click.Path(path_type=Path), default=Path("/tmp/specpipe-curve"), show_default=True)
    @click.option("--lr", type=float, default=None, help="the head's peak learning rate (default: its kind's)")
    @click.option("--batch-tokens", type=int, default=None, help="the head's tokens per step (default: its kind's)")
    @click.option("--ttt-steps", type=int, default=None, help="the head's training-time test steps (default: DistillConfig's)")
    @click.option("--train-dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True)
    @click.option("--threads", type=int, default=None, help="torch threads (default: DistillConfig's)")
    @click.option("--init-head", type=click.Path(exists=True, path_type=Path), default=None,
                  help="start the head from this one's weights (train it further on a new budget)")
    @click.option("--save-head", type=click.Path(path_type=Path), default=None,
                  help="write the head's final weights here (upstream's EAGLE-3 format, as distill does)")
    @click.option("--replot", type=click.Path(exists=True, path_type=Path), multiple=True,
                  help="no training: the runs of earlier --json files, in one plot and table")
    def command(target, answer_tokens, train_tokens, model_train_tokens, points, first_tokens, kinds, minutes, plot_path,
                json_path, work, lr, batch_tokens, ttt_steps, train_dtype, threads, init_head, save_head, replot):
        try:
            if replot:
                parts = [json.loads(p.read_text()) for p in replot]
                result = {**parts[0], "runs": [r for part in parts for r in part["runs"]]}
            else:
                cfg = DistillConfig(target=target, out=work, kind="eagle3", answer_tokens=answer_tokens,
                                    train_tokens=train_tokens, minutes=minutes, force=True, train_dtype=train_dtype,
                                    **({"threads": threads} if threads else {}),
                                    lr=lr, batch_tokens=batch_tokens, **({"ttt_steps": ttt_steps} if ttt_steps else {}),
                                    init_head=init_head)
                result = run_curve(cfg, kinds=tuple(kinds.split(",")), points=points, first_tokens=first_tokens,
                                   model_train_tokens=model_train_tokens, save_head=save_head,
                                   log=lambda m: click.echo(m, err=True))
        except (SpecpipeError, ValueError, KeyError) as err:
            click.echo(f"error: {str(err).splitlines()[0]}", err=True)
            raise SystemExit(2) from None
        runs = [CurveRun(r["kind"], r["points"], r["train_s"], r.get("label", "")) for r in result["runs"]]
        if plot_path:
            teacher = result["teacher"]
            plot_curve(runs, plot_path, f"{target}: {teacher['answer_tokens']:,} answer tokens, "
                       f"{teacher['held_out_tokens']:,} held out (split by prompt); {result['machine_summary']}")
        if json_path:
            json_path.write_text(json.dumps(result, indent=1) + "\n")
        click.echo(table(runs))

    command.main(args=argv, prog_name="python -m specpipe.distill.curve", standalone_mode=True)


if __name__ == "__main__":
    main()
