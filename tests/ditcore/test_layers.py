"""ditcore's import graph is one-way: each layer imports only layers below it (and its own subpackage).

Run as a script to print the graph: `python tests/ditcore/test_layers.py`.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "packages" / "ditcore" / "src"

# Lowest first. Within a layer, subpackages never import each other (models, codecs, data and diffusion are
# siblings that share only the layout and the inputs below them).
LAYERS = [
    # files written whole with the umask's mode; third parties quietened; a signal recorded, acted on at a safe point
    {"ditcore.durable", "ditcore.quiet", "ditcore.stopping"},
    {"ditcore.disk", "ditcore.safe_state", "ditcore.tensorfile"},  # files read safely, written whole
    {"ditcore", "ditcore.errors", "ditcore.layout", "ditcore.media", "ditcore.cli", "ditcore.choices"},
    {"ditcore.inputs"},  # a model's inputs: what the loader, the objectives, the probes and the samplers build
    {"ditcore.models", "ditcore.codecs", "ditcore.data", "ditcore.diffusion"},
    {"ditcore.parallel", "ditcore.testing", "ditcore.export", "ditcore.sampling", "ditcore.training",
     "ditcore.interop"},  # interop: the field's DiT checkpoints in, diffusers out
    {"ditcore.job", "ditcore.cuda_keeps"},  # a training job's layout; CUDA's saved tensors, for the memory record
    {"ditcore.probe"},  # one run of the model at a rank's shapes, which memory, traffic and the FLOP count watch
    {"ditcore.runs", "ditcore.memory", "ditcore.eval"},  # eval: held-out loss, FID/FD
    # communication per step: counted (ditcore.parallel.counting) and modelled; FLOPs, probed at the planner's batch
    {"ditcore.traffic", "ditcore.flops"},
    {"ditcore.speed"},  # step time, tokens/s and MFU predicted from FLOPs, memory and traffic; layout search
    {"ditcore.init_from"},
]


def import_graph(root: Path = SRC) -> dict[str, set[str]]:
    """module → the ditcore modules it imports (at module level or inside functions)."""
    graph = {}
    for f in sorted(root.rglob("*.py")):
        module = ".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "ditcore":  # from ditcore import runs
                deps |= {f"ditcore.{a.name}" for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ditcore":
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.split(".")[0] == "ditcore"}
        graph[module] = deps - {module}
    return graph


def unit(module: str) -> str:
    """The layer entry a module belongs to: its subpackage (ditcore.models.dit → ditcore.models) or itself."""
    parts = module.split(".")
    return ".".join(parts[:2])


def layer(module: str) -> int:
    for i, names in enumerate(LAYERS):
        if unit(module) in names:
            return i
    raise AssertionError(f"{module} is in no layer: add {unit(module)} to LAYERS in {Path(__file__).name}")


def test_every_import_goes_down_a_layer_or_stays_in_its_subpackage():
    upward = []
    for module, deps in import_graph().items():
        for dep in deps:
            if unit(dep) != unit(module) and layer(dep) >= layer(module) and unit(dep) != "ditcore":
                upward.append(f"{module} -> {dep}")
    assert not upward, "imports that are not one-way:\n" + "\n".join(sorted(upward))


def test_the_model_files_have_no_process_groups_or_collectives():
    for f in (SRC / "ditcore" / "models").glob("*.py"):
        tree = ast.parse(f.read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not {m for m in imported if m.startswith(("torch.distributed", "ditcore.parallel", "megatron"))}, f
        collective = {n for n in names if ("group" in n and "grouped" not in n)  # a grouped matmul is not a group
                      or n.startswith(("all_", "reduce_", "broadcast", "dist"))}
        assert not collective, f"{f.name} uses {sorted(collective)}: parallelism belongs in ditcore.parallel"


def test_the_files_the_sources_cite_are_in_the_repository():
    """A comment that sends the reader to a note must send them somewhere they can read: a .md in the repository."""
    import re

    repo = SRC.parents[2]
    cited = {(f.relative_to(repo).as_posix(), name) for f in [*SRC.rglob("*.py"), *repo.glob("apps/*/src/**/*.py")]
             for name in re.findall(r"[\w./-]+\.md\b", f.read_text())}
    missing = sorted(f"{f}: {name}" for f, name in cited if not (repo / name).is_file())
    assert not missing, "cited files that are not in the repository:\n" + "\n".join(missing)


def test_only_st_dit_and_its_registration_know_st_dit():
    """ST-DiT regroups tokens through its rows' `permutation` and tells the traffic model what its all-to-alls send
    through its registration (ditcore.models.registry): no other module of the library or the apps imports its model
    file, and none recognises a class by its name (`type(x).__name__ == "TemporalBlock"`) instead of asking the
    registration or the object."""
    repo = SRC.parents[2]
    graph = import_graph() | {m: d for app in repo.glob("apps/*/src") for m, d in import_graph(app).items()}
    importers = sorted(m for m, deps in graph.items() if "ditcore.models.stdit" in deps)
    assert importers == ["ditcore.models"], f"modules that import ST-DiT's model file: {importers}"
    by_name = []
    for f in [*SRC.rglob("*.py"), *repo.glob("apps/*/src/**/*.py")]:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(side, ast.Attribute) and side.attr == "__name__"
                                                     for side in [node.left, *node.comparators]):
                by_name.append(f"{f.relative_to(repo)}:{node.lineno}")
    assert not by_name, "classes recognised by their name:\n" + "\n".join(by_name)


def reached_from(roots: set[str], graph: dict[str, set[str]]) -> set[str]:
    """Every ditcore module that importing `roots` may import. `from ditcore.data import loader_state` records only
    ditcore.data: a reached subpackage counts with all its modules."""
    reached, todo = set(), list(roots)
    while todo:
        dep = todo.pop()
        for module in graph:
            if module not in reached and (module == dep or (dep != "ditcore" and module.startswith(dep + "."))):
                reached.add(module)
                todo.extend(graph[module])
    return reached


def test_dit_sample_reads_checkpoints_without_ditcore_parallel():
    """dit-sample loads a training checkpoint's weights on one device: neither its modules nor ditcore.runs (the
    owner of the checkpoint format, and of reading it) may need process groups or their shims for that."""
    sample = import_graph(SRC.parents[2] / "apps" / "sample" / "src")
    assert {"dit_sample.app", "dit_sample.cli", "dit_sample.generate"} <= sample.keys()
    roots = set().union(*sample.values()) | {"ditcore.runs"}
    reached = reached_from(roots, import_graph())
    parallel = sorted(m for m in reached if unit(m) == "ditcore.parallel")
    assert not parallel, f"dit-sample or ditcore.runs imports {parallel}"
    assert "ditcore.runs.weights" in reached  # the walk reaches the reader it vouches for


if __name__ == "__main__":
    for module, deps in import_graph().items():
        print(f"{module:34s} -> {', '.join(sorted(deps)) or '-'}")
