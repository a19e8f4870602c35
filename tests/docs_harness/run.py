"""Run code blocks of the docs inside harnesses: ``python run.py HARNESS=BLOCK_FILE ...``.

Each BLOCK_FILE holds one block's code, padded with blank lines so that a traceback names
the page's own line (see ``tests/test_docs_snippets.py``, which writes them). HARNESS is
a module beside this file whose ``namespace()`` gives the names the block uses but does
not define (a model, an optimizer, ``train_step``...), and whose ``after(namespace)``,
if any, checks what the block did. The blocks run one after another in this process
(under ``trainguard run`` on every rank), each in a fresh namespace but in the same
process: a process group one block's harness set up is the next one's (a group cannot
be made again on the same rendezvous once destroyed). Each block that completes prints
``docs block ok: <file>``.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any


def run_block(harness_name: str, block: Path) -> None:
    harness = importlib.import_module(harness_name)
    first_line = block.read_text(encoding="utf-8").splitlines()[0]
    source = first_line.removeprefix("# docs block: ").strip()  # e.g. docs/checkpoints.md
    namespace: dict[str, Any] = {"__name__": "__main__", "__file__": str(block)}
    namespace.update(harness.namespace())
    code = compile(block.read_text(encoding="utf-8"), source, "exec")
    exec(code, namespace)
    after = getattr(harness, "after", None)
    if after is not None:
        after(namespace)
    print(f"docs block ok: {block.name}", flush=True)


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    for pair in argv:
        harness_name, _, block = pair.partition("=")
        run_block(harness_name, Path(block))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
