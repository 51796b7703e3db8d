"""Every command and Python block of README.md, infra/README.md and docs/*.md runs as written.

Each ```bash block carries a marker on the line before it, which says whether this test runs it:
`<!-- readme-test: cheap -->` (seconds on a CPU: run by `make test`), `<!-- readme-test: slow -->` (run by
`make test-slow`) or `<!-- readme-test: skip REASON -->` (a GPU, the hub, a Slurm cluster, minutes of training: the
reason says which). A ```python block runs unless marked slow or skip. The cheap blocks run in document order in one
working directory (a temporary copy of the repository's layout, its `.venv` the one running these tests), as a user
pastes them from the repository root, and the Python blocks run after them there (the loader's block reads the
dataset the block before it prepared); each slow block runs alone in a fresh one.

Beside running them: every example that trains names a run directory of its own (none lands in another example's
run and resumes it), every run a command samples is one that a command of these files trains, and every relative
link and anchor resolves.
"""

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", ROOT / "infra" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCES = ["packages/ditcore/src", "apps/prepare/src", "apps/train/src", "apps/sample/src"]
VENV = Path(sys.prefix)  # the environment running the tests: .venv under make test
BLOCK = re.compile(r"(?:<!-- readme-test: (\w+)\s*(.*?)\s*-->\n)?^```(bash|python)\n(.*?)^```", re.S | re.M)
KINDS = {"cheap", "slow", "skip"}
TIMEOUT_S = 600


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    kind: str  # cheap, slow, skip; a python block without a marker is cheap
    reason: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for path in FILES:
        text = path.read_text()
        for m in BLOCK.finditer(text):
            kind, reason, lang, code = m.groups()
            line = text.count("\n", 0, m.start(3)) + 1  # the fence's line
            found.append(Block(path, line, lang, kind or ("cheap" if lang == "python" else ""), reason, code))
    return found


BLOCKS = blocks()


def of(kind: str, lang: str | None = None) -> list[Block]:
    return [b for b in BLOCKS if b.kind == kind and (lang is None or b.lang == lang)]


def environment() -> dict[str, str]:
    """The repository's sources first on the path (a checkout's code, not whatever the venv installed), and no
    hub: a command that would reach for one fails at once."""
    path = os.pathsep.join(str(ROOT / s) for s in SOURCES)
    return os.environ | {"PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                         "PYTHONWARNINGS": "ignore", "COLUMNS": "120"}


def workdir(path: Path) -> Path:
    """A folder laid out as the repository root (its files linked, not copied), with .venv the running one: the
    commands' relative paths (.venv/bin/..., infra/slurm/..., bench/...) resolve as in a checkout, and what they
    write (data/, runs/, out/) stays in the temporary folder."""
    path.mkdir(parents=True, exist_ok=True)
    for entry in ROOT.iterdir():
        if entry.name not in {".venv", ".git", "data", "runs", "out"}:
            (path / entry.name).symlink_to(entry)
    (path / ".venv").symlink_to(VENV)
    return path


def run(block: Block, cwd: Path) -> subprocess.CompletedProcess:
    if block.lang == "bash":
        cmd = ["bash", "-e", "-o", "pipefail", "-c", block.code]
    else:
        script = cwd / f"block-{block.path.stem}-{block.line}.py"  # a file: Fabric's launcher starts it again
        script.write_text(block.code)
        cmd = [str(VENV / "bin" / "python"), str(script)]
    return subprocess.run(cmd, cwd=cwd, env=environment(), capture_output=True, text=True, timeout=TIMEOUT_S)


def failure(block: Block, proc: subprocess.CompletedProcess) -> str:
    return f"{block.name} exited {proc.returncode}:\n{block.code}\n--- stdout\n{proc.stdout[-1500:]}\n" \
           f"--- stderr\n{proc.stderr[-3000:]}"


needs_venv = pytest.mark.skipif(not (VENV / "bin" / "dit-train").exists(),
                                reason=f"{VENV} is not an environment with the apps installed (make install)")


# --------------------------------------------------------------------------------------------------
# What the test runs, and why the rest is not run


def test_every_bash_block_says_whether_this_test_runs_it_and_every_skip_says_why():
    assert len(of("cheap", "bash")) >= 5 and len(of("cheap", "python")) >= 5  # the files were read
    unmarked = [b.name for b in BLOCKS if b.kind not in KINDS]
    assert not unmarked, f"blocks without a readme-test marker (cheap, slow or skip REASON): {unmarked}"
    unexplained = [b.name for b in of("skip") if len(b.reason.split()) < 3]
    assert not unexplained, f"skipped blocks without a reason: {unexplained}"
    assert len(of("skip", "python")) == 0  # every Python block runs


# --------------------------------------------------------------------------------------------------
# Running them


@pytest.fixture(scope="module")
def cheap_run(tmp_path_factory) -> tuple[Path, dict[Block, subprocess.CompletedProcess]]:
    """The cheap bash blocks of every file, in document order, in one working directory."""
    cwd = workdir(tmp_path_factory.mktemp("readme") / "repo")
    return cwd, {block: run(block, cwd) for block in of("cheap", "bash")}


@needs_venv
@pytest.mark.parametrize("block", of("cheap", "bash"), ids=lambda b: b.name)
def test_cheap_commands_run_as_written(cheap_run, block):
    _, results = cheap_run
    assert results[block].returncode == 0, failure(block, results[block])


@needs_venv
@pytest.mark.parametrize("block", of("cheap", "python"), ids=lambda b: b.name)
def test_python_blocks_run_as_written(cheap_run, block):
    cwd, _ = cheap_run
    proc = run(block, cwd)
    assert proc.returncode == 0, failure(block, proc)


@needs_venv
@pytest.mark.slow
@pytest.mark.parametrize("block", of("slow"), ids=lambda b: b.name)
def test_slow_blocks_run_as_written(tmp_path, block):
    proc = run(block, workdir(tmp_path / "repo"))
    assert proc.returncode == 0, failure(block, proc)


def test_the_first_run_trains_and_exports(cheap_run):
    """The README's first training command really trained: its run directory holds an export and a checkpoint."""
    cwd, _ = cheap_run
    run_dir = cwd / "runs" / "mock-tiny"
    assert (run_dir / "export" / "model.safetensors").is_file()
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-0000003"]


# --------------------------------------------------------------------------------------------------
# Run directories: each training example its own; each sampled run one that an example trains


def commands() -> list[str]:
    """Every command line of every bash block (continuations joined, comments dropped)."""
    lines = []
    for block in BLOCKS:
        if block.lang == "bash":
            lines += [line.split(" #")[0].strip() for line in block.code.replace("\\\n", " ").splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def shipped_run_dir(config: str) -> str:
    path = ROOT / "apps" / "train" / "configs" / f"{config}.yaml"
    return yaml.safe_load(path.read_text())["train"]["run_dir"] if path.is_file() else ""


def trainings() -> list[tuple[str, str, str]]:
    """(command, config, run dir) of every dit-train command that trains (not --plan, --print-config, --help), and
    of every train.sbatch submission."""
    found = []
    for cmd in commands():
        m = re.search(r"dit-train --config (\S+)|train\.sbatch (\S+)", cmd)
        if not m or any(flag in cmd for flag in ("--plan", "--print-config", "--help")):
            continue
        config = Path(m[1] or m[2]).stem
        explicit = re.search(r"train\.run_dir=(\S+)", cmd)
        found.append((cmd, config, explicit[1] if explicit else shipped_run_dir(config)))
    return found


LAYOUT_AND_PLACE = ("parallel.", "data.path=", "train.run_dir=")  # a checkpoint resumes under any layout


def test_every_training_example_writes_to_a_run_directory_of_its_own():
    """An example that changes a shipped recipe (any override but data.path) names its train.run_dir; and no two
    different recipes (config and overrides, the layout and data path aside) share one, so that none resumes (or
    refuses) another's checkpoints."""
    runs: dict[str, set[str]] = {}
    for cmd, config, run_dir in trainings():
        overrides = {o.split("=")[0] for o in re.findall(r"\s([a-z_]+\.[a-z_.]+=\S+)", cmd)}
        if overrides - {"data.path", "train.run_dir"}:
            assert "train.run_dir" in overrides, f"a changed recipe without its own train.run_dir: {cmd}"
        recipe = " ".join(sorted({config, *(o for o in re.findall(r"\s([a-z_]+\.[a-z_.]+=\S+)", cmd)
                                             if not o.startswith(LAYOUT_AND_PLACE))}))
        runs.setdefault(run_dir, set()).add(recipe)
    shared = {run_dir: recipes for run_dir, recipes in runs.items() if len(recipes) > 1}
    assert not shared, f"run directories that different examples train into: {shared}"
    assert "runs/demo-tp2" in runs and "runs/mock-tiny" in runs  # found at all


def test_every_run_a_command_samples_is_one_a_command_trains():
    trained = {run_dir for _, _, run_dir in trainings()} | {"runs/demo"}  # make demo's
    sampled = set()
    for cmd in commands():
        m = re.search(r"dit-sample \w+ --checkpoint (runs/[^/\s]+)", cmd)
        if m:
            sampled.add(m[1])
    assert sampled, "no dit-sample command found"
    assert sampled <= trained, f"runs sampled that no command trains: {sorted(sampled - trained)}"


# --------------------------------------------------------------------------------------------------
# Links


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for path in FILES:
        text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"https?:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
