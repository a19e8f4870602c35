"""``trainguard resume JOB [-f FILE]``: a job whose controller died goes on.

The job keeps its id (so its durable checkpoints under ``<durableUrl>/<job id>`` are
found), its directory and its token. Its spec is the stored one, or ``-f FILE`` (the
same job): the stored spec has its secrets redacted, which is enough to re-attach to
live agents (they hold their environment) but not to start new ones; secrets are then
taken from ``--env-file`` and the caller's environment, as ``trainguard run`` does.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence

from trainguard.platform.launch import JobToRun, launch, usage
from trainguard.platform.store import JobNotFound, JobRow, StateDirError, Store, open_store
from trainguard.platform.target import Resume
from trainguard.platform.views import TERMINAL_PHASES, effective_phase
from trainguard.spec import SpecError, load_job, parse_job, resolve_plan
from trainguard.spec.plan import JobPlan
from trainguard.spec.secrets import SecretSource, redact_spec

__all__ = ["lost_twin", "resume_command", "resume_job"]

REDACTED = "***"  # what a redacted value (or a URL's password) reads in a stored spec


def resume_command(args: argparse.Namespace) -> int:
    try:
        store = open_store(args.state_dir)
    except StateDirError as exc:
        return usage(str(exc))
    try:
        try:
            job = store.job(args.job)
        except JobNotFound as exc:
            return usage(str(exc))
        return resume_job(store, job, args.file, args.env_file or [])
    finally:
        store.close()


def lost_twin(store: Store, plan: JobPlan) -> JobRow | None:
    """The newest job named like ``plan``'s when it is Lost and ran the very same spec
    (``trainguard run -f job.yaml`` of a job whose controller died goes on with it)."""
    job = store.newest_named(plan.name)
    if job is None or effective_phase(job) != "Lost":
        return None
    same = redact_spec(plan.job.model_dump(mode="json", by_alias=True))
    return job if json.loads(job.spec_json) == same else None


def resume_job(store: Store, job: JobRow, file: str | None, env_files: Sequence[str]) -> int:
    """Resume ``job`` (see the module docstring); the exit code."""
    phase = effective_phase(job)
    if phase != "Lost":
        what = "is still running" if phase not in TERMINAL_PHASES else "ended"
        return usage(
            f"job {job.id} {what} (phase {phase}); only a Lost job (its controller died) "
            "can be resumed"
        )
    try:
        source = file or f"the stored spec of {job.id}"
        spec = load_job(file) if file else parse_job(json.loads(job.spec_json), source)
        if spec.metadata.name != job.name:
            return usage(
                f"{file}: metadata.name is {spec.metadata.name!r}, but job {job.id} is {job.name!r}"
            )
        plan = resolve_plan(spec, source, SecretSource.load(env_files, os.environ))
    except (SpecError, ValueError) as exc:  # ValueError: an unreadable --env-file
        return usage(str(exc))
    blocked = None
    if not file and REDACTED in job.spec_json:
        blocked = f"its stored spec has redacted secrets: resume it with -f {job.source or 'FILE'}"
    return launch(JobToRun(plan, store, job.source or source), Resume(job, blocked))
