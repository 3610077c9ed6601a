"""The package's layers, read from the source: no import cycle between modules, and no module importing a
layer above its own (function-level imports included: a lazy import is still a dependency).

The layers, lowest first, are the ones docs/architecture.md draws.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Installed package name of each source folder (data/ and losses/ sit beside mmpt/ and install into it).
PACKAGES = {"mmpt": ROOT / "mmpt", "mmpt.data": ROOT / "data", "mmpt.losses": ROOT / "losses"}
LAYERS = (
    ("mmpt.errors", "mmpt.artifacts", "mmpt.registry"),
    ("mmpt.distributed",),
    ("mmpt.losses",),
    ("mmpt.data",),
    ("mmpt.demo",),
    ("mmpt.config",),
    ("mmpt.models",),
    ("mmpt.eval",),
    ("mmpt.pretrained",),
    ("mmpt.methods",),
    ("mmpt.config_loader",),
    ("mmpt.export",),
    ("mmpt.release",),
    ("mmpt.engine",),
    ("mmpt.plan",),
    ("mmpt", "mmpt.cli", "mmpt.commands", "mmpt.clip_benchmark", "mmpt.config_reference"),
)


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            if package == "mmpt" and parts[0] in ("data", "losses"):
                continue
            found[name] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The mmpt modules `name` imports anywhere in its file (`from mmpt import x` counts as mmpt.x when x is
    a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {module for module in found if module in known and module != name}


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(name, path, set(found)) for name, path in found.items()}


def layer_of(module: str) -> int:
    best, depth = None, -1
    for index, members in enumerate(LAYERS):
        for member in members:
            if (module == member or module.startswith(member + ".")) and len(member) > depth:
                best, depth = index, len(member)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS (and to docs/architecture.md)")
    return best


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return groups


def test_every_module_has_a_layer():
    for module in graph():
        layer_of(module)


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_no_module_imports_a_layer_above_its_own():
    upward = sorted(
        f"{source} imports {target}"
        for source, targets in graph().items()
        for target in targets
        if layer_of(target) > layer_of(source)
    )
    assert upward == []


def test_the_checks_see_a_cycle_and_an_upward_import():
    """The checks themselves, on a graph with a known cycle and a known upward import."""
    edges = {"mmpt.methods.a": {"mmpt.engine.b"}, "mmpt.engine.b": {"mmpt.methods.a"}, "mmpt.config": set()}
    assert cycles(edges) == [["mmpt.engine.b", "mmpt.methods.a"]]
    assert layer_of("mmpt.engine.b") > layer_of("mmpt.methods.a")


@pytest.mark.parametrize(
    "statement,expected",
    [
        ("from mmpt import distributed as mdist", {"mmpt.distributed"}),
        ("from mmpt.data.loader import StatefulLoader", {"mmpt.data.loader"}),
        ("from . import trainer", {"mmpt.engine.trainer"}),
        ("from .trainer import train", {"mmpt.engine.trainer"}),
        ("import mmpt.release", {"mmpt.release"}),
    ],
)
def test_imports_are_read_as_modules(tmp_path, statement, expected):
    path = tmp_path / "x.py"
    path.write_text(f"def f():\n    {statement}\n")
    known = set(modules())
    assert imports_of("mmpt.engine.x", path, known) == expected


def test_the_loop_and_the_checkpoints_name_no_test_scaffolding_and_no_method():
    """Fault injection and the heartbeat reach the loop only as step hooks; the checkpoint code knows parts,
    not the features (or methods) that own them."""
    from mmpt.methods import list_methods

    loop = (ROOT / "mmpt/engine/trainer.py").read_text().lower()
    for word in ("fault", "watchdog", "heartbeat", "beat(", "handoff", "sharded"):
        assert word not in loop, f"mmpt/engine/trainer.py mentions {word!r}"
    for path in sorted((ROOT / "mmpt/engine/checkpoint").glob("*.py")):
        code = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith(("#", '"')))
        for word in (*list_methods(), "momentum_copies", "ShardedCopies", "zero3.copies", "fault"):
            assert word.lower() not in code.lower(), f"{path.relative_to(ROOT)} names {word!r}"


def test_every_package_and_data_file_goes_into_the_wheel():
    """pyproject's explicit package list is what a wheel holds: a subpackage or data file missing from it imports
    from a checkout (the editable install maps whole folders) and is absent once installed."""
    from fnmatch import fnmatchcase

    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {
        ".".join((package, *init.parent.relative_to(folder).parts))
        for package, folder in PACKAGES.items()
        for init in folder.rglob("__init__.py")
    }
    configs = ROOT / "configs"  # the shipped configs: YAML files under their method's folder
    data_only = {"mmpt.configs", *(f"mmpt.configs.{folder.name}" for folder in configs.iterdir() if folder.is_dir())}
    assert found | data_only == set(setuptools["packages"])
    data = setuptools["package-data"]
    files = [("mmpt.configs", configs, path) for path in configs.rglob("*")]
    files += [
        ("mmpt", PACKAGES["mmpt"], path) for path in PACKAGES["mmpt"].rglob("*") if path.suffix not in {".py", ".pyc"}
    ]
    for top, folder, path in files:
        if path.is_file() and "__pycache__" not in path.parts:
            package = ".".join((top, *path.parent.relative_to(folder).parts))
            patterns = [*data.get("*", []), *data.get(package, [])]
            assert any(fnmatchcase(path.name, p) for p in patterns), f"{path} is not in package-data"
