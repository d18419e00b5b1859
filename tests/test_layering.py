"""The package's layout says its flow: every import points down the stage order in the package docstring."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import lightning_hetero

PACKAGE = Path(lightning_hetero.__file__).parent
# Lowest first, as in the package docstring; the modules at the top level sit above every stage. A stage is a folder,
# or a folder inside a capability's folder placed lower than the capability (``split/decisions``: the split's pure
# decisions, which the shared layers and the other training modes use too).
STAGES = (
    "runtime",
    "emulate",
    "measure",
    "split/decisions",
    "configure",
    "precision",
    "comm",
    "train",
    "watch",
    "recover",
    "split",
    "local",
    "pipeline",
    "simulate",
)


def package_imports(path: Path, at_run_time: bool = False) -> list[tuple[int, str]]:
    """The package modules ``path`` imports anywhere in its code (top-level or inside functions), by dotted name;
    ``at_run_time``: leaving out those under ``if TYPE_CHECKING:``, which only the type checker reads."""
    tree = ast.parse(path.read_text())
    type_only = set()
    if at_run_time:
        for block in ast.walk(tree):
            if isinstance(block, ast.If) and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING":
                type_only |= {id(node) for statement in block.body for node in ast.walk(statement)}
    # A relative import (``from .training import ...``) names its module from the importing file's package.
    package = ["lightning_hetero", *path.relative_to(PACKAGE).parent.parts]
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level:
            base = ".".join(package[: len(package) - (node.level - 1)])
            module = f"{base}.{node.module}" if node.module else base
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
            found.append((node.lineno, module))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_hetero"):
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("lightning_hetero")]
    return found


def stage_of(dotted: str) -> str | None:
    """The stage a module belongs to: the longest stage folder that holds it; None for a top-level module."""
    parts = dotted.split(".")[1:]
    holding = [stage for stage in STAGES if parts[: len(stage.split("/"))] == stage.split("/")]
    return max(holding, key=len) if holding else None


def level(dotted: str) -> int:
    """A module's place in the stage order; the top-level modules (strategy, settings, cli) come after every stage."""
    if "." not in dotted:
        return -1  # the package itself: only its public names, checked below
    stage = stage_of(dotted)
    return STAGES.index(stage) if stage is not None else len(STAGES)


def test_a_relative_import_is_named_from_the_importing_package(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    (tmp_path / "split").mkdir()
    init = tmp_path / "split" / "__init__.py"
    init.write_text("from .training import Mode\nfrom .. import settings\nfrom . import steps\n")
    names = {name for _, name in package_imports(init)}
    assert {
        "lightning_hetero.split.training.Mode",
        "lightning_hetero.settings",
        "lightning_hetero.split.steps",
    } <= names


def test_level_places_a_module_in_its_innermost_stage():
    assert stage_of("lightning_hetero.split.decisions.planner") == "split/decisions"
    assert stage_of("lightning_hetero.split.decisions") == "split/decisions"
    assert stage_of("lightning_hetero.split.training") == "split"
    assert stage_of("lightning_hetero.split") == "split"
    assert stage_of("lightning_hetero.splitter") is None
    assert stage_of("lightning_hetero.strategy") is None
    assert level("lightning_hetero.split.decisions.split") < level("lightning_hetero.train.loaders")
    assert level("lightning_hetero.train.loaders") < level("lightning_hetero.split.steps")
    assert level("lightning_hetero.strategy") == len(STAGES)


def test_every_stage_folder_is_in_the_documented_order_and_nothing_else_is_a_folder():
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("__"))
    assert folders == sorted({stage.split("/")[0] for stage in STAGES})
    for stage in STAGES:
        assert (PACKAGE / stage / "__init__.py").is_file(), f"{stage}/ is not a package"
    documented = [
        line.split()[0] for line in lightning_hetero.__doc__.splitlines() if re.match(r"    [a-z_/]+/( |$)", line)
    ]
    assert documented == [f"{stage}/" for stage in STAGES], "the package docstring lists the stages in another order"


def test_a_capability_holding_a_lower_stage_imports_nothing_in_its_init():
    """Importing ``split.decisions`` from ``train/`` runs ``split/__init__.py`` first: an import there of the
    capability's training mode would pull the layers above ``train/`` into every import of the decisions, a cycle
    through ``train/`` whenever a module of it is the first to import them."""
    for stage in STAGES:
        parts = stage.split("/")
        for depth in range(1, len(parts)):
            init = PACKAGE.joinpath(*parts[:depth], "__init__.py")
            assert not package_imports(init), f"{init.relative_to(PACKAGE)} imports from the package"


def test_imports_point_down_the_stage_order_and_no_stage_imports_the_strategy():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if len(relative.parts) == 1:
            continue  # strategy.py, settings.py, cli.py, __init__.py: the top may import every stage
        own = ".".join(("lightning_hetero", *relative.with_suffix("").parts))
        for line, target in package_imports(path):
            if target == "lightning_hetero" or level(target) > level(own):
                upward.append(f"{relative}:{line} imports {target}")
    assert not upward, "imports pointing up the stage order:\n" + "\n".join(upward)


def test_no_import_cycle_between_modules():
    # (an import for the type checker alone, `if TYPE_CHECKING:`, runs never; it is refused apart, below)
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(("lightning_hetero", *path.relative_to(PACKAGE).with_suffix("").parts))
        modules[name.removesuffix(".__init__")] = path
    graph = {
        name: {
            t
            for _, t in package_imports(path, at_run_time=True)
            if t in modules and t != name and not name.startswith(t + ".")
        }
        for name, path in modules.items()
    }
    visiting, done, cycles = [], set(), []

    def visit(name):
        if name in done:
            return
        if name in visiting:
            cycles.append(visiting[visiting.index(name) :] + [name])
            return
        visiting.append(name)
        for target in sorted(graph[name]):
            visit(target)
        visiting.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


def test_lines_are_not_packed_past_the_formatter():
    """`ruff format` decides the line breaks: at most a handful of `# fmt: skip` in the repository's Python, each with
    its reason after it (`# fmt: skip (why)`), so that no call is packed onto one line to save lines."""
    root = PACKAGE.parent
    markers = []
    for folder in ("lightning_hetero", "tests", "benchmarks", "examples"):
        for path in sorted((root / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if "fmt: skip" in line or "fmt: off" in line:
                    markers.append((f"{path.relative_to(root)}:{number}", line.split("#", 1)[-1].strip()))
    this_test = [marker for marker in markers if marker[0].startswith("tests/test_layering.py")]
    markers = [marker for marker in markers if marker not in this_test]
    unexplained = [where for where, comment in markers if not re.search(r"fmt: skip \(.+\)", comment)]
    assert not unexplained, "a `# fmt: skip` without its reason: " + ", ".join(unexplained)
    assert len(markers) <= 5, f"{len(markers)} `# fmt: skip` markers: " + ", ".join(where for where, _ in markers)


def test_no_module_imports_the_job_or_the_strategy_back():
    """The facade points down: only the strategy imports the job, and only the package's entry points import the
    strategy, not even for the type checker (an object the job builds gets its inputs by name, not the job)."""
    allowed = {"lightning_hetero.job": {"strategy.py"}, "lightning_hetero.strategy": {"__init__.py", "ray.py"}}
    back = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = str(path.relative_to(PACKAGE))
        for line, target in package_imports(path):
            for facade, importers in allowed.items():
                if (target == facade or target.startswith(facade + ".")) and relative not in importers:
                    back.append(f"{relative}:{line} imports {target}")
    assert not back, "imports of the facade from below it:\n" + "\n".join(back)
