"""The shape of the code: no import circles, modules and classes that fit in a head, the core free
of the swarm and of asyncio, and ddp behind the strategy interface (``test_lobby.py``: the lobby
is pure).

Imports are read from the source (every ``import`` statement, those inside functions and under
``TYPE_CHECKING`` too), so a circle hidden by a lazy import is still one.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "p2p_cocodc"
MAX_MODULE_LINES = 800
MAX_CLASS_LINES = 500
WHOLE_CLASSES = {"p2p_cocodc.swarm.round.RoundMachine"}  # the pure round machine may stay whole


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = modules()


def imports(path: Path) -> set[str]:
    """The package's modules ``path`` imports, anywhere in it."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("p2p_cocodc"):
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.startswith("p2p_cocodc"))
    return {name for name in names if name in MODULES}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_circles_are_found() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles() -> None:
    graph = {name: imports(path) - {name} for name, path in MODULES.items()}
    # a package's __init__ imports nothing of ours, so a module importing its package is no circle
    assert all(not graph[name] for name, path in MODULES.items() if path.name == "__init__.py")
    assert circles(graph) == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_and_classes_fit_in_a_head(name: str) -> None:
    text = MODULES[name].read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_MODULE_LINES, f"{name} has more than {MAX_MODULE_LINES} lines"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and f"{name}.{node.name}" not in WHOLE_CLASSES:
            lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            assert lines <= MAX_CLASS_LINES, f"class {name}.{node.name} has {lines} lines"


def test_the_core_knows_nothing_of_the_swarm_or_the_drivers() -> None:
    """algorithms/ imports only itself and the two leaf modules (errors, names), and no asyncio."""
    for name, path in MODULES.items():
        if name.startswith("p2p_cocodc.algorithms"):
            allowed = {"p2p_cocodc.errors", "p2p_cocodc.names"}
            foreign = {m for m in imports(path) if not m.startswith("p2p_cocodc.algorithms")} - allowed
            assert not foreign, f"{name} imports {sorted(foreign)}"
            assert not re.search(r"^\s*(import|from) asyncio", path.read_text(encoding="utf-8"), re.M), name


def test_ddp_is_a_strategy_like_the_others() -> None:
    """No driver asks which algorithm it runs: only algorithms/ and the options' rules name ddp, and
    what the options know of it (``names.AVERAGE_GRADIENTS``) is what its strategy says."""
    from p2p_cocodc.algorithms.strategies import make_strategy
    from p2p_cocodc.config.train import TrainConfig
    from p2p_cocodc.models.build import build_model
    from p2p_cocodc.names import ALGORITHMS, AVERAGE_GRADIENTS

    for algo in ALGORITHMS:
        settings = TrainConfig(algo=algo).algo_settings()
        strategy = make_strategy(build_model("nano", 64, 16), settings)
        assert strategy.averages_gradients == (algo in AVERAGE_GRADIENTS) != strategy.takes_state, algo
    allowed = ("p2p_cocodc.algorithms.", "p2p_cocodc.names", "p2p_cocodc.config.")
    for name, path in MODULES.items():
        if name.startswith(allowed):
            continue
        text = path.read_text(encoding="utf-8")
        asks = re.search(r"isinstance\([^)]*\b(DataParallel|Strategy)\b", text)
        assert not asks, f"{name} asks which algorithm it runs"
        assert not re.search(r"""algo\s*[!=]=\s*["']ddp["']""", text), f"{name} branches on ddp"
