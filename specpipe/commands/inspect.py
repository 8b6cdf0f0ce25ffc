"""`specpipe inspect`: what a checkpoint is, without loading its weights."""

from __future__ import annotations

import json

import click


@click.command()
@click.argument("checkpoint")
@click.option("--allow-pickle", is_flag=True, help="Accept pickle (.bin) weights. Only for checkpoints you trust.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def inspect(checkpoint: str, allow_pickle: bool, as_json: bool) -> None:
    """Architecture, parameters, dtype, vocab, special tokens and tokenizer hash of CHECKPOINT.

    CHECKPOINT is a Hugging Face checkpoint folder, a .gguf file (converted once, cached), or an
    alias such as smollm2-135m.
    """
    from specpipe.checkpoint import inspect_checkpoint, resolve_checkpoint

    resolved = resolve_checkpoint(checkpoint, allow_pickle=allow_pickle)
    info = inspect_checkpoint(resolved.path)
    report = {"resolved": resolved.as_dict(), "checkpoint": info.model_dump(mode="json")}
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{checkpoint} ({resolved.kind})", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    rows = {
        "path": str(resolved.path),
        "architecture": f"{info.architecture} ({info.model_type})",
        "parameters": f"{info.num_parameters:,}" if info.num_parameters is not None else "unknown",
        "layers / hidden / heads / kv heads": f"{info.num_layers} / {info.hidden_size} / {info.num_heads} / {info.num_kv_heads}",
        "dtype / format": f"{info.dtype} / {info.weights_format} ({info.weights_bytes / 1e6:,.1f} MB)",
        "vocab (model / tokenizer)": f"{info.vocab_size} / {info.tokenizer_vocab_size}",
        "context": str(info.max_position_embeddings),
        "tied embeddings": str(info.tie_word_embeddings),
        "bos / eos / pad": " / ".join(
            f"{tok!r} ({tid})" if tok is not None else "none"
            for tok, tid in ((info.bos_token, info.bos_token_id), (info.eos_token, info.eos_token_id), (info.pad_token, info.pad_token_id))
        ),
        "stop ids": ", ".join(map(str, info.eos_token_ids)),
        "chat template": "yes" if info.has_chat_template else "no",
        "tokenizer hash": info.tokenizer_hash,
        "weights sha256": resolved.weights_sha256,
    }
    if info.converted_from:
        rows["converted from"] = f"{info.converted_from['gguf_file']} (sha256 {info.converted_from['gguf_sha256'][:16]}…)"
    for key, value in rows.items():
        table.add_row(key, value)
    Console().print(table)
