"""The control plane is pure logic: it never imports a platform, sockets or processes."""

import ast
from pathlib import Path

import trainguard.control

FORBIDDEN = {
    "socket",
    "subprocess",
    "http",
    "urllib",
    "threading",
    "multiprocessing",
    "sqlite3",
    "time",
    "trainguard.platform",
    "trainguard.agent",
    "torch",
}


def test_control_imports_nothing_impure() -> None:
    root = Path(trainguard.control.__file__).parent
    offenders = []
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if any(name == f or name.startswith(f + ".") for f in FORBIDDEN):
                    offenders.append(f"{path.name}: {name}")
    assert offenders == []
