"""`specpipe generate`: in-process on engines/<name>, or through a Triton server with --url."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import click

from specpipe.config import RuntimeConfig, field_default, field_help, make_config
from specpipe.contract.decoding import DecodingPolicy
from specpipe.contract.generation import GenerationConfig, SamplingConfig
from specpipe.errors import UsageError


@click.command()
@click.argument("engine_dir", required=False, type=click.Path(path_type=Path))
@click.option("--prompt", "-p", required=True, help="Prompt text.")
@click.option("--chat", is_flag=True, help="Apply the tokenizer's chat template to the prompt.")
@click.option("--max-tokens", type=int, default=field_default(GenerationConfig, "max_new_tokens"), show_default=True,
              help="Maximum new tokens.")
@click.option("--num-draft-tokens", "-k", type=int, default=None,
              help=f"Fix K, the tokens drafted per step. Default: adaptive K, starting at "
                   f"{field_default(GenerationConfig, 'num_draft_tokens')}.")
@click.option("--no-speculative", is_flag=True, help="Target alone on the same engine (the baseline).")
@click.option("--temperature", type=float, default=field_default(SamplingConfig, "temperature"), show_default=True,
              help="0 = greedy.")
@click.option("--top-k", type=int, default=field_default(SamplingConfig, "top_k"), show_default=True, help="0 = off.")
@click.option("--top-p", type=float, default=field_default(SamplingConfig, "top_p"), show_default=True, help="In (0, 1].")
@click.option("--seed", type=int, default=None, help="Seed for reproducible sampling.")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--threads", type=int, default=field_default(RuntimeConfig, "threads"), show_default=True,
              help=field_help(RuntimeConfig, "threads") + ".")
@click.option("--draft", "head", type=click.Path(path_type=Path, exists=True, file_okay=False), default=None,
              help="An EAGLE-3 head folder to draft with instead of the deployment's draft (in-process; the target "
                   "engine must output the head's feature layers).")
@click.option("--url", default=None, help="Triton gRPC address (e.g. 127.0.0.1:8001) instead of ENGINE_DIR.")
@click.option("--stream", is_flag=True, help="Print text as it is accepted.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the text and statistics.")
def generate(engine_dir: Optional[Path], prompt, chat, max_tokens, num_draft_tokens, no_speculative, temperature, top_k,
             top_p, seed, stop, threads, head, url, stream, as_json) -> None:
    """Generate text with speculative decoding from ENGINE_DIR (engines/NAME) or a server (--url)."""
    sampling = make_config(SamplingConfig, temperature=temperature, top_k=top_k, top_p=top_p)
    if num_draft_tokens is not None and num_draft_tokens < 1:  # -k fixes K; the target alone is --no-speculative
        raise UsageError(f"--num-draft-tokens: Input should be greater than or equal to 1, got {num_draft_tokens}")
    asked = DecodingPolicy.requested(0 if no_speculative else num_draft_tokens)
    cfg = make_config(GenerationConfig, sampling=sampling, max_new_tokens=max_tokens, **asked, stop=list(stop), seed=seed)
    runtime = make_config(RuntimeConfig, threads=threads)
    if (engine_dir is None) == (url is None):
        raise UsageError("give either ENGINE_DIR or --url")
    if head is not None and url is not None:
        raise UsageError("--draft runs in-process: give ENGINE_DIR, not --url")
    if url is not None:
        from specpipe.triton.client import remote_generate

        deltas = remote_generate(url, prompt, cfg, stream=stream, chat=chat)
        for delta in deltas:
            if not as_json:
                click.echo(delta, nl=False)
        result = deltas.result
    else:
        from specpipe.deployment import load_deployment

        deployment = load_deployment(engine_dir, threads=runtime.threads, head=head)
        cfg = deployment.generation_config(**cfg.model_dump())
        generation = deployment.generator.start(deployment.generator.encode(prompt, chat), cfg)
        for chunk in generation:
            if stream and not as_json:
                click.echo(chunk.text, nl=False)
        result = generation.result.as_dict()
        if not stream and not as_json:
            click.echo(result["text"], nl=False)
    if as_json:
        click.echo(json.dumps(result))
    else:
        click.echo()
        click.echo(
            f"[{result['num_generated']} tokens, {result['tokens_per_s']:.1f} tok/s, TTFT {result['ttft_ms']:.0f} ms, "
            f"acceptance {result['acceptance_rate']:.2f}, mean accepted len {result['mean_accepted_len']:.2f}]",
            err=True,
        )
