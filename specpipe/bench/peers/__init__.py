"""The peers: CPU engines a user might deploy instead of specpipe, run on the same pair in the same bench run.

Each peer converts the deployment's checkpoints with its own tooling (cached under specpipe's cache,
`peers/<peer>/`) and runs the same prompt ids, greedy, with the same thread count and token limit.
hf comes with specpipe; openvino and ortgenai with `pip install 'specpipe[peers]'`, llamacpp with
`'specpipe[peers-llamacpp]'` (it builds llama.cpp from source). A peer whose package is
missing, or whose conversion fails, becomes one note line in the results, never a failed bench.

At int8 / int4 (a deployment whose target is quantized: the peers convert to the same precision), each peer
that can give teacher-forced logits (its module's `accuracy`) has its quantized target scored against its own
fp32 by specpipe's accuracy check (quantize/accuracy.py: perplexity, top-1 agreement, KL, on the packaged
held-out evaluation set) and held to the deployment's budget: `peer_accuracy`.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, get_args

from specpipe.bench.config import PeerName
from specpipe.bench.peers.common import PRECISION_OF_QUANT, PeerPair, PeerRow, source_gguf
from specpipe.errors import SpecpipeError, UsageError

PEER_NAMES: tuple[str, ...] = get_args(PeerName)


@dataclass(frozen=True)
class PeerSpec:
    module: str  # specpipe.bench.peers.<module>: `rows(PeerPair) -> (rows, notes)`
    packages: tuple[str, ...]  # importable modules it needs
    what: str  # the engine, for notes
    distributions: tuple[str, ...]  # the installed distributions whose versions the results record
    extra: str = "peers"  # the pyproject extra that installs it ("": specpipe's own dependencies)


PEERS: dict[str, PeerSpec] = {
    "hf": PeerSpec("hf", ("transformers", "torch"), "transformers generate()", ("transformers", "torch"), extra=""),
    "openvino": PeerSpec("openvino", ("openvino_genai", "optimum.intel"), "OpenVINO GenAI (optimum-intel export)",
                         ("openvino-genai", "openvino", "optimum-intel")),
    "ortgenai": PeerSpec("ortgenai", ("onnxruntime_genai",), "onnxruntime-genai (its model builder)",
                         ("onnxruntime-genai", "onnxruntime")),
    "llamacpp": PeerSpec("llamacpp", ("llama_cpp",), "llama.cpp (llama-cpp-python)", ("llama-cpp-python",),
                         extra="peers-llamacpp"),
}


def parse_peers(text: str) -> list[str]:
    """"hf,openvino" -> ["hf", "openvino"]; "all" -> every peer; "" or "none" -> []."""
    names = [part.strip().lower() for part in text.split(",") if part.strip()]
    if names == ["none"]:
        return []
    if names == ["all"]:
        return list(PEER_NAMES)
    unknown = [name for name in names if name not in PEERS]
    if unknown:
        raise UsageError(f"--peer {text!r}: unknown peer {', '.join(unknown)} (known: {', '.join(PEER_NAMES)}, all, none)")
    return list(dict.fromkeys(names))


def missing_packages(name: str) -> list[str]:
    """The modules a peer needs that cannot be imported here."""
    missing = []
    for module in PEERS[name].packages:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package that is absent or half-installed
            found = False
        if not found:
            missing.append(module)
    return missing


def missing_note(name: str) -> Optional[str]:
    """One line saying a peer is not installed, or None when it is."""
    missing = missing_packages(name)
    if not missing:
        return None
    extra = PEERS[name].extra
    install = f"pip install 'specpipe[{extra}]'" if extra else "pip install specpipe"
    return f"{name}: not installed ({', '.join(missing)} missing; {install})"


def peer_versions(names: list[str]) -> dict[str, str]:
    """Versions of the installed peers' packages, for the results (absolute numbers hold for these versions)."""
    from specpipe.bench.peers.common import package_version

    return {dist: package_version(dist) for name in names if not missing_packages(name)
            for dist in PEERS[name].distributions}


def pair_from_manifest(manifest: dict, threads: int, draft_lengths: list[int], head_dir: Optional[Path] = None,
                       head_layers: tuple[int, ...] = ()) -> tuple[Optional[PeerPair], Optional[str]]:
    """The deployment's pair as torch checkpoints, or (None, why) when they cannot be found. `head_dir`: the
    EAGLE-3 head that drafts in this bench (the deployment's or `--draft HEAD`), reading `head_layers`."""
    target = manifest.get("target", {})
    draft = manifest.get("draft", {})
    target_dir = target.get("resolved_path")
    if not target_dir or not Path(target_dir).is_dir():
        return None, f"the target's torch checkpoint is not found ({target_dir})"
    draft_dir = None
    if draft.get("kind", "model") == "model":
        draft_dir = draft.get("resolved_path")
        if not draft_dir or not Path(draft_dir).is_dir():
            return None, f"the draft's torch checkpoint is not found ({draft_dir})"
        draft_dir = Path(draft_dir)
    quant = target.get("engine", {}).get("quant", "none")
    pair = PeerPair(
        target_dir=Path(target_dir), draft_dir=draft_dir,
        eos_token_ids=tuple(manifest.get("eos_token_ids", [])) or (target.get("checkpoint", {}).get("eos_token_id", 0),),
        threads=threads, draft_lengths=tuple(draft_lengths), precision=PRECISION_OF_QUANT.get(quant, "fp32"),
        target_gguf=source_gguf(target), draft_gguf=source_gguf(draft) if draft_dir is not None else None,
        head_dir=Path(head_dir) if head_dir is not None else None, head_layers=tuple(head_layers),
    )
    return pair, None


def peer_module(name: str):
    """A peer's module (specpipe.bench.peers.<module>): `rows(pair)`, and `accuracy(pair, batches)` where it has one."""
    return importlib.import_module(f"specpipe.bench.peers.{PEERS[name].module}")


def peer_accuracy(names: list[str], manifest: dict, threads: int, tokenizer,
                  say=lambda text: None) -> tuple[list[dict], list[str]]:
    """At a quantized deployment's precision: specpipe's own target accuracy (from its manifest) and each installed
    peer's quantized target against that peer's fp32, on the same evaluation set and budget. Returns (one dict
    per model: peer (None = specpipe), precision, model, the AccuracyReport's numbers, within_budget, violations;
    one note line per model). Nothing at fp32."""
    from specpipe.contract.quant import AccuracyBudget, QuantConfig
    from specpipe.quantize.accuracy import budget_violations
    from specpipe.quantize.calibration import evaluation_batches

    pair, _ = pair_from_manifest(manifest, threads, [])
    if pair is None or pair.precision == "fp32" or not names:
        return [], []
    quant = manifest.get("target", {}).get("quant") or {}
    budget = AccuracyBudget(**quant["budget"]) if quant.get("budget") else AccuracyBudget()
    entries, notes = [], []

    def add(peer: Optional[str], model: str, report: dict) -> None:
        from specpipe.contract.quant import AccuracyReport

        violations = budget_violations(AccuracyReport(**report), budget)
        entries.append({"peer": peer, "precision": pair.precision, "model": model, **report,
                        "within_budget": not violations, "violations": [v.as_dict() for v in violations]})
        verdict = "within the budget" if not violations else "over the budget (" + ", ".join(
            f"{v.metric} {v.value:.3g} vs {v.limit:.3g}" for v in violations) + ")"
        notes.append(f"accuracy {peer or 'specpipe'} {model} vs its fp32: perplexity {report['ppl_rel_change']:+.1%}, "
                     f"top-1 {report['top1_agreement']:.3f}, mean KL {report['mean_kl']:.3f}: {verdict}")

    if quant.get("accuracy"):
        add(None, manifest["target"]["engine"]["quant"], quant["accuracy"])
    batches = evaluation_batches(tokenizer, QuantConfig())
    for name in names:
        module = peer_module(name) if not missing_packages(name) else None
        if module is None or not hasattr(module, "accuracy"):
            continue
        say(f"{name}: scoring its {pair.precision} target against its fp32")
        try:
            report, model = module.accuracy(pair, batches)
        except Exception as err:  # as in peer_rows: a peer's failure is a note, never a failed bench
            notes.append(f"accuracy {name}: skipped: {(str(err).strip().splitlines() or [type(err).__name__])[0]}")
            continue
        add(name, model, report.as_dict())
    return entries, notes


def peer_rows(names: list[str], manifest: dict, threads: int, draft_lengths: list[int],
              say=lambda text: None, head_dir: Optional[Path] = None,
              head_layers: tuple[int, ...] = ()) -> tuple[list[PeerRow], list[str]]:
    """Every available peer's rows for a deployment, and one note per peer skipped or partly skipped.
    `head_dir`, `head_layers`: the EAGLE-3 head drafting in this bench, for the peers that run one."""
    rows: list[PeerRow] = []
    notes: list[str] = []
    if not names:
        return rows, notes
    pair, why = pair_from_manifest(manifest, threads, draft_lengths, head_dir, head_layers)
    if pair is None:
        return rows, [f"{', '.join(names)}: skipped: {why}"]
    if pair.draft_dir is None and pair.head_dir is None:
        kind = manifest.get("draft", {}).get("kind", "none")
        notes.append(f"peers: no draft model in this deployment (draft {kind!r}): target-only and prompt-lookup rows only")
    elif pair.head_dir is not None:
        notes.append("peers: the draft is an EAGLE-3 head: its rows where a peer runs such heads (openvino), "
                     "target-only and prompt-lookup rows for the others")
    for name in names:
        note = missing_note(name)
        if note:
            notes.append(note)
            continue
        say(f"{name}: converting and loading")
        try:
            extra_rows, extra_notes = peer_module(name).rows(pair)
        except SpecpipeError as err:
            notes.append(f"{name}: skipped: {err}")
            continue
        except Exception as err:  # a peer's own failure (its runtime refusing a model) must not end the bench
            first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
            notes.append(f"{name}: skipped: {PEERS[name].what} failed: {first_line}")
            continue
        rows += extra_rows
        notes += [f"{name}: {text}" for text in extra_notes]
    return rows, notes
