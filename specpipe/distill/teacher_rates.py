"""Answer tokens per second of each teacher on the same batch of training prompts, in interleaved rounds.

    python -m specpipe.distill.teacher_rates --threads 1 --rounds 2

The batch is the first --batch training prompts (a distill run's first teacher batch: greedy, features of the
default EAGLE-3 layers, top-32), answered whole by each teacher in turn (A B C D, A B C D, ...), so load on a shared
machine falls on all alike. Also prints what `--teacher-engine auto`'s probe (and its run-off) picks, and how many answers equal the
torch fp32 teacher's. docs/eagle3.md section 3d has its numbers.
"""

from __future__ import annotations

import json
import os
import statistics
import time

DEFAULT_TEACHERS = "torch bfloat16,onnx int8-wo,torch float32,onnx fp32"


def main(argv=None) -> None:
    import click

    @click.command(help=__doc__.split("\n\n")[0])
    @click.option("--target", default="smollm2-135m", show_default=True)
    @click.option("--threads", type=int, default=1, show_default=True)
    @click.option("--rounds", type=int, default=2, show_default=True)
    @click.option("--batch", type=int, default=48, show_default=True)
    @click.option("--max-answer-tokens", type=int, default=160, show_default=True)
    @click.option("--teachers", "names", default=DEFAULT_TEACHERS, show_default=True)
    def command(target, threads, rounds, batch, max_answer_tokens, names):
        import torch

        from specpipe.checkpoint import load_causal_lm, load_tokenizer, resolve_checkpoint
        from specpipe.distill.prompts import training_prompts
        from specpipe.distill.run import _eos_ids
        from specpipe.distill.teacher import chat_ids
        from specpipe.distill.teachers import PROBE_ROWS, Teacher, Teachers, choose_teacher
        from specpipe.distill.verdict import ExportedTargets
        from specpipe.export.features import default_layers
        from specpipe.machine import describe_machine

        torch.set_num_threads(threads)
        resolved = resolve_checkpoint(target)
        tokenizer, model = load_tokenizer(resolved.path), load_causal_lm(resolved.path)
        prompts = training_prompts(0)[:batch]
        ids = chat_ids(tokenizer, prompts)
        eos = _eos_ids(resolved.path, tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
        layers = default_layers(model.config.num_hidden_layers)
        teachers = [Teacher.parse(name.strip()) for name in names.split(",")]
        click.echo(describe_machine(threads).summary())
        with ExportedTargets(resolved.path, layers) as targets:
            pool = Teachers(model, torch.device("cpu"), targets=targets, threads=threads, batch_rows=batch, top_k=32,
                            feature_layers=layers)
            probe_ids = [tokenizer(p["prompt"])["input_ids"] for p in prompts[:PROBE_ROWS]]
            choice = choose_teacher(teachers, torch.device("cpu"), lambda t: pool.probe(t, probe_ids),
                                    make_runoff=lambda t: pool.runoff(t, ids))
            click.echo(f"probe: {choice.describe()}")
            rates: dict = {t.name: [] for t in teachers}
            answers: dict = {}
            for round_index in range(rounds):
                for teacher in teachers:
                    answer = pool.answerer(teacher)
                    t0 = time.perf_counter()
                    sequences = answer(ids, kinds=[p["kind"] for p in prompts], max_new_tokens=max_answer_tokens,
                                       eos_token_ids=eos, pad_token_id=pad, top_k=32, feature_layers=layers)
                    seconds = time.perf_counter() - t0
                    tokens = sum(s.answer_tokens for s in sequences)
                    rates[teacher.name].append(tokens / seconds)
                    answers[teacher.name] = [s.token_ids.tolist() for s in sequences]
                    click.echo(json.dumps({"round": round_index, "teacher": teacher.name, "answer_tokens": tokens,
                                           "seconds": round(seconds, 1), "tokens_per_s": round(tokens / seconds, 1),
                                           "load_1min": round(os.getloadavg()[0], 2)}))
        reference = answers.get("torch float32")
        for name, values in rates.items():
            same = (f"; answers equal to torch fp32's: {sum(a == b for a, b in zip(answers[name], reference))}/{batch}"
                    if reference else "")
            click.echo(f"{name}: median {statistics.median(values):.1f} answer tokens/s "
                       f"(rounds {[round(v, 1) for v in values]}){same}")

    command.main(args=argv, prog_name="python -m specpipe.distill.teacher_rates", standalone_mode=True)


if __name__ == "__main__":
    main()
