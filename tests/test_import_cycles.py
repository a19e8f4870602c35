"""trainguard's modules import one another without a cycle (issue 40 removed the last six).

Every import of a trainguard module counts, at module level, inside a function, or under
``if TYPE_CHECKING`` alike: a cycle hidden by any of these is still two modules that
cannot be read, tested or changed apart.
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def module_graph(src: Path) -> dict[str, set[str]]:
    """Each trainguard module -> the trainguard modules it imports (a package's
    ``__init__`` is the package; ``from pkg import name`` is ``pkg``, and ``pkg.name``
    too where that is a module)."""
    modules = {}
    for path in (src / "trainguard").rglob("*.py"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: list[str] = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # The package itself too: importing from it runs its __init__ first.
                targets += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        found = {resolve(t) for t in targets if t.startswith("trainguard")}
        # A module's own package (its __init__) is not an edge back to it.
        graph[name] = {t for t in found if t and t != name and not name.startswith(t + ".")}
    return graph


def test_no_module_of_trainguard_is_part_of_an_import_cycle() -> None:
    graph = module_graph(SRC)
    assert len(graph) > 200  # the walk found the package
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as exc:
        raise AssertionError(f"import cycle: {' -> '.join(exc.args[1])}") from None


def test_a_cycle_is_found_and_named(tmp_path: Path) -> None:
    package = tmp_path / "trainguard"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from trainguard.b import f\n")
    (package / "b.py").write_text("def f():\n    from trainguard import a\n")
    graph = module_graph(tmp_path)
    assert graph == {
        "trainguard": set(),
        "trainguard.a": {"trainguard.b"},
        "trainguard.b": {"trainguard.a"},
    }
    try:
        TopologicalSorter(graph).prepare()
    except CycleError:
        return
    raise AssertionError("the cycle a -> b -> a was not found")
