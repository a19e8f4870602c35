"""Check, before anything starts, that a local job's Python script is there.

A worker command ``python [-u] SCRIPT ...`` (after the plan's rewriting: a launcher line
stripped, ``python`` made trainguard's interpreter) runs ``SCRIPT`` in the container's
``workingDir``. A relative ``SCRIPT`` is found there; a relative ``workingDir``, and a
relative ``SCRIPT`` without one, against the directory ``trainguard run`` was started in
(the agents start the workers there). A script that is not there would fail every
attempt with ``FileNotFoundError`` and burn the restart budget: it is a spec error (exit
2) instead. Other commands (``-m MODULE``, a shell, an interpreter option) are not read.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from trainguard.spec.load import SpecError
from trainguard.spec.plan import JobPlan
from trainguard.spec.pytorchjob import as_written

__all__ = ["check_scripts", "python_script"]

_PYTHON = re.compile(r"^python(3(\.\d+)?)?$")


def python_script(argv: Sequence[str]) -> str | None:
    """The ``SCRIPT`` of ``python [-u] SCRIPT ...`` (any ``python``, ``python3``,
    ``python3.X`` or this interpreter), else None."""
    if not argv:
        return None
    exe = argv[0]
    if not (_PYTHON.match(os.path.basename(exe)) or exe == sys.executable):
        return None
    rest = list(argv[1:])
    while rest and rest[0] == "-u":
        rest.pop(0)
    if not rest or rest[0].startswith("-"):
        return None
    return rest[0]


def check_scripts(plan: JobPlan, source: str, cwd: Path | None = None) -> None:
    """SpecError (naming ``source`` and the container) for each group whose working
    directory or Python script is not there; ``cwd``: where ``trainguard run`` runs."""
    here = Path.cwd() if cwd is None else cwd
    problems: list[tuple[str, str]] = []
    for index, group in enumerate(plan.groups):
        where = f"spec.replicaSpecs[{index}].template.spec.containers[0]"
        base = here / group.working_dir if group.working_dir else here
        if group.working_dir and not base.is_dir():
            problems.append((f"{where}.workingDir", f"{base}: no such directory"))
            continue
        script = python_script(group.command)
        if script is None:
            continue
        path = base / script
        if not path.is_file():
            what = "is a directory" if path.is_dir() else "not found"
            against = "" if Path(script).is_absolute() else f" (relative to {base})"
            problems.append((f"{where}.command", f"script {script}: {what}{against}"))
    if problems:
        job = plan.job
        groups = [group.name for group in job.spec.replica_specs]
        raise SpecError(source, as_written(job.metadata.annotations, groups, problems))
