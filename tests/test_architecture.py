"""The package is a pipeline: no module imports a later stage, and no modules import each other in a circle.

Every `import` and `from ... import` in specpipe counts, at module level and inside functions alike (a lazy
import is still a dependency; it only moves the failure to run time). The failures print the offending
edges, `importer -> imported`, so the fix starts from the message.
"""

from __future__ import annotations

import ast
from pathlib import Path

import specpipe

PACKAGE = Path(specpipe.__file__).parent

# The stages in the order data flows through them, earliest first. A module may import its own stage and
# earlier ones, never a later one. A name covers that module or package and everything under it.
#
#   foundation    errors, what every config shares (config.py) and the machine record
#   contract      the types that pass between stages: the manifest, step and batch costs, quantization mode and
#                 accuracy report, sampling and generation config, draft kinds (the floor every stage stands on)
#   checkpoint    resolve, load and describe a checkpoint; the model facts (alias registry)
#   export        Hugging Face -> ONNX, checked against torch
#   engines       the runtimes behind one Engine interface (ONNX Runtime, TensorRT), engine.json. Below
#                 quantize: quantization rewrites an engine's graph and measures the result by running it
#                 (accuracy, speed), so it needs the runtime, while no runtime needs the quantizer
#   quantize      weight-only, W8A8 and fp8 graphs, calibration, accuracy budgets
#   speculative   drafters, the acceptance rule and the decoding loop
#   drafts        the draft kinds (model, self, eagle3, ngram, none), one module each, and their registry: each owns
#                 its manifest entry, decoding policy, proposer and build step (the builder hands that step its tools)
#   deployment    deployment.py, which opens a built folder as engines + drafter; testing/ holds what tests share
#   triton        the served repository (model config, Python model, client and server)
#   gate          the validation gate: greedy, distribution, quantization and latency checks
#   measure       bench (speed on prompt sets) and distill (train a draft): each runs a deployment; neither
#                 knows the other
#   builder       `specpipe build` for every backend: plan, run, choose a draft (builds on all of the above,
#                 bench for draft choice, distill's record for a draft's known acceptance)
#   commands      the click commands, and the demo that strings them together
#   cli           the command group and `python -m specpipe`
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("specpipe", "specpipe.errors", "specpipe.config", "specpipe.machine")),
    ("contract", ("specpipe.contract",)),
    ("checkpoint", ("specpipe.checkpoint",)),
    ("export", ("specpipe.export",)),
    ("engines", ("specpipe.engines",)),
    ("quantize", ("specpipe.quantize",)),
    ("speculative", ("specpipe.speculative",)),
    ("drafts", ("specpipe.drafts",)),
    ("deployment", ("specpipe.deployment", "specpipe.testing")),
    ("triton", ("specpipe.triton",)),
    ("gate", ("specpipe.gate",)),
    ("measure", ("specpipe.bench", "specpipe.distill")),
    ("builder", ("specpipe.builder",)),
    ("commands", ("specpipe.commands", "specpipe.demo")),
    ("cli", ("specpipe.cli", "specpipe.__main__")),
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imported_names(module: str, path: Path) -> list[str]:
    """Every specpipe name `module` imports, anywhere in the file, as a dotted name (`a.b.c` for `from a.b import c`)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            names += [f"{base}.{alias.name}" for alias in node.names]
    return [name for name in names if name == "specpipe" or name.startswith("specpipe.")]


def import_edges() -> set[tuple[str, str]]:
    """(importer, imported) module pairs; an imported name resolves to the longest module path it starts with."""
    modules = _modules()
    edges = set()
    for module, path in modules.items():
        for name in _imported_names(module, path):
            while name not in modules:
                name = name.rpartition(".")[0]
            if name != module:
                edges.add((module, name))
    return edges


def stage_of(module: str) -> tuple[int, str]:
    """(rank, stage name) of the most specific STAGES entry covering `module`."""
    best = None
    for rank, (stage, prefixes) in enumerate(STAGES):
        for prefix in prefixes:
            covers = module == prefix or (prefix != "specpipe" and module.startswith(prefix + "."))
            if covers and (best is None or len(prefix) > best[0]):
                best = (len(prefix), rank, stage)
    assert best is not None, f"{module} is in no stage: add it to STAGES in {Path(__file__).name}"
    return best[1], best[2]


def _unit(module: str) -> str:
    """The folder or top-level module a module belongs to: specpipe.builder.plan -> specpipe.builder."""
    return ".".join(module.split(".")[:2])


def circles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each sorted."""
    graph: dict[str, list[str]] = {}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def _describe(component: list[str], edges: set[tuple[str, str]], unit=lambda m: m) -> str:
    members = set(component)
    inside = sorted({(a, b) for a, b in edges if unit(a) in members and unit(b) in members and unit(a) != unit(b)})
    return "circle " + " <-> ".join(component) + ":\n" + "\n".join(f"    {a} -> {b}" for a, b in inside)


def test_every_module_has_a_stage():
    for module in _modules():
        stage_of(module)


def backward_imports(edges: set[tuple[str, str]]) -> list[str]:
    """Each import of a later stage, as `importer (stage) -> imported (stage)`."""
    return [
        f"  {a} ({stage_of(a)[1]}) -> {b} ({stage_of(b)[1]})"
        for a, b in sorted(edges) if stage_of(b)[0] > stage_of(a)[0]
    ]  # fmt: skip


def test_no_module_imports_a_later_stage():
    backward = backward_imports(import_edges())
    assert not backward, "imports of a later stage:\n" + "\n".join(backward)


def test_no_import_circles():
    edges = import_edges()
    # folders and top-level modules of one stage in a circle (across stages a circle is a backward import)
    unit_edges = {(_unit(a), _unit(b)) for a, b in edges if _unit(a) != _unit(b) and stage_of(a) == stage_of(b)}
    found = {frozenset(c): _describe(c, edges) for c in circles(edges)}
    found.update({frozenset(c): _describe(c, edges, _unit) for c in circles(unit_edges)})
    assert not found, "import circles:\n" + "\n".join(found.values())


# A stage's own config (specpipe/<stage>/config.py) is for that stage and for the commands that build it.
CONFIG_READERS = ("specpipe.commands", "specpipe.demo", "specpipe.cli")


def foreign_config_imports(edges: set[tuple[str, str]]) -> list[str]:
    """Each import of another stage's config module, as `importer -> imported`."""
    return [
        f"  {a} -> {b}" for a, b in sorted(edges)
        if b.endswith(".config") and b != "specpipe.config" and _unit(a) != _unit(b)
        and not a.startswith(CONFIG_READERS)
    ]  # fmt: skip


def test_no_stage_imports_another_stages_config():
    foreign = foreign_config_imports(import_edges())
    assert not foreign, "imports of another stage's config (move the shared type to specpipe/contract/):\n" + "\n".join(foreign)


def test_the_checks_catch_what_they_check():
    """A planted backward edge and a planted circle are reported (the checks can fail)."""
    planted = {("specpipe.engines.tensorrt", "specpipe.builder.plan"), ("specpipe.builder.plan", "specpipe.engines.tensorrt")}
    assert backward_imports(planted) == ["  specpipe.engines.tensorrt (engines) -> specpipe.builder.plan (builder)"]
    assert circles({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")}) == [["a", "b", "c"]]
    assert circles({("a", "b"), ("b", "c")}) == []
    assert foreign_config_imports({("specpipe.bench.run", "specpipe.builder.config")}) == [
        "  specpipe.bench.run -> specpipe.builder.config"]
    assert foreign_config_imports({("specpipe.builder.cpu", "specpipe.builder.config"),
                                   ("specpipe.commands.build", "specpipe.builder.config")}) == []
