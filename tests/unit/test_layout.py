"""The shape of the package, measured: the entrance stays a registry, every module has a floor, and no import
goes back up a floor or round in a circle. Read from the source with ast; nothing is imported."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "ddp_amp"

FLOORS = [
    ("ddp_amp.__main__", "ddp_amp.cli"),
    ("ddp_amp.commands",),
    ("ddp_amp.measure",),
    ("ddp_amp.launch",),
    ("ddp_amp.results",),
    ("ddp_amp.worker", "ddp_amp.loop"),
    ("ddp_amp.rank",),
    ("ddp_amp.checkpoint",),
    ("ddp_amp.train",),
    ("ddp_amp.parallel",),
    ("ddp_amp.tasks",),
    ("ddp_amp.progress",),
    ("ddp_amp.config", "ddp_amp.dist", "ddp_amp.precision", "ddp_amp.network", "ddp_amp.process",
     "ddp_amp.outputs", "ddp_amp.files", "ddp_amp.errors", "ddp_amp"),
]
"""Top to bottom: a module may import from its own floor or any floor below, never from one above. The leaves
at the bottom are what both sides (the launcher and the ranks) share."""


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def floor_of(module: str) -> int:
    for index, names in enumerate(FLOORS):
        if any(module == name or module.startswith(name + ".") for name in names if name != "ddp_amp"):
            return index
    if module == "ddp_amp":
        return len(FLOORS) - 1
    raise AssertionError(f"{module} has no floor in FLOORS")


def imports_of(module: str) -> set[str]:
    """The project's modules that `module` imports, at the top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ddp_amp":
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "ddp_amp")
    found.discard(module)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_cli_is_a_registry_of_at_most_200_lines():
    lines = len((PACKAGE / "cli.py").read_text().splitlines())
    assert lines <= 200, f"cli.py has {lines} lines"


def test_at_most_10_modules_loose_at_the_top():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(loose) <= 10, loose


def test_no_function_over_60_lines():
    long = [f"{module}.{fn.name} ({fn.end_lineno - fn.lineno + 1} lines)" for module, path in MODULES.items()
            for fn in functions(ast.parse(path.read_text())) if fn.end_lineno - fn.lineno + 1 > 60]
    assert not long, long


def test_every_module_has_a_floor_and_no_import_goes_up_one():
    upward = [f"{module} (floor {floor_of(module)}) imports {target} (floor {floor_of(target)})"
              for module, targets in GRAPH.items() for target in targets if floor_of(target) < floor_of(module)]
    assert not upward, upward


def test_no_import_circles():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                pytest.fail("import circle: " + " -> ".join(path[path.index(target):] + [target]))
            if target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)


def test_the_floor_rule_would_catch_an_upward_import():
    """The checker itself: a rank module importing the launcher's session is one floor violation."""
    assert floor_of("ddp_amp.rank.setup") > floor_of("ddp_amp.launch.session")
