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

A block's namespace lives until the process ends, as a script's globals do: freed in the
middle of the run, a whole script's DDP model can be the last owner of the process group
the script destroyed, and freeing it joins the gloo threads under the GIL while one of
them waits for the GIL to free its last work (the torch deadlock
:mod:`trainguard.agent.script_end` describes; this job's template preloads no torch, so
its guard is not installed). Before the end, the thread lets go of the GIL for a moment,
as that guard does, so that no gloo thread still waits for it when the interpreter
finalizes.
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path
from typing import Any

LET_GO_SECONDS = 0.1  # trainguard.agent.script_end.LET_GO_SECONDS


def run_block(harness_name: str, block: Path) -> dict[str, Any]:
    """Run one block; its namespace, which the caller keeps until the process ends."""
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
    return namespace


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    namespaces = []
    for pair in argv:
        harness_name, _, block = pair.partition("=")
        namespaces.append(run_block(harness_name, Path(block)))
    time.sleep(LET_GO_SECONDS)
    _kept.extend(namespaces)
    return 0


_kept: list[dict[str, Any]] = []  # every block's namespace, freed as the process ends


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
