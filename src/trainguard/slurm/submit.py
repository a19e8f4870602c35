"""``trainguard submit --slurm -f job.yaml [sbatch options]``: write the job's batch script
and hand it to ``sbatch``.

The script is what a user would write by hand (docs/slurm.md shows one)::

    #!/bin/sh
    #SBATCH --job-name=NAME
    #SBATCH --nodes=N          # the job's replicas and its spares
    #SBATCH --no-kill          # a node lost does not end the allocation: trainguard recovers
    #SBATCH --requeue          # trainguard may requeue the job when no node is left
    #SBATCH --output=STATE/slurm/NAME-%j.out
    #SBATCH --open-mode=append # a requeued run's output follows the first run's
    export TRAINGUARD_STATE_DIR=STATE
    cd SUBMIT_DIR
    exec PYTHON -m trainguard.cli run -f STATE/slurm/NAME-STAMP.yaml

The spec is copied next to the script (as ``sbatch`` copies the script): editing the file
after submitting does not change a queued job. The state directory and the spec's paths
must be on a filesystem the allocation's first node shares with this host (a home or
project directory on a cluster): ``list``, ``describe`` and ``logs`` read it here.

The sbatch options given after the spec come after the script's own ``#SBATCH`` lines on
sbatch's command line, where sbatch lets them win (``--nodes=4`` for more spares).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from trainguard.platform.launch import EXIT_USAGE, usage
from trainguard.platform.store import StateDirError, open_store
from trainguard.spec import SpecError, load_job, resolve_plan
from trainguard.spec.plan import JobPlan
from trainguard.spec.scripts import check_scripts

__all__ = ["batch_script", "submit_slurm"]

SBATCH_TIMEOUT = 60.0


def batch_script(
    plan: JobPlan, spec: Path, state_dir: Path, workdir: Path, python: str = sys.executable
) -> str:
    """The batch script that runs ``plan`` (read from ``spec``) in its allocation."""
    spares = sum(group.spares for group in plan.groups)
    out = state_dir / "slurm" / f"{plan.name}-%j.out"
    run = [python, "-m", "trainguard.cli", "run", "-f", str(spec)]
    lines = [
        "#!/bin/sh",
        f"#SBATCH --job-name={plan.name}",
        f"#SBATCH --nodes={plan.nnodes + spares}",
        "#SBATCH --no-kill",
        "#SBATCH --requeue",
        f"#SBATCH --output={out}",
        "#SBATCH --open-mode=append",
        "# Written by trainguard submit --slurm: the job's replicas"
        + (f" and its {spares} spare(s)" if spares else "")
        + "; a lost node is trainguard's to recover (--no-kill),",
        "# and when no node is left it requeues the job (--requeue), which resumes from its",
        "# newest durable checkpoint under the same trainguard job id.",
        f"export TRAINGUARD_STATE_DIR={shlex.quote(str(state_dir))}",
        f"cd {shlex.quote(str(workdir))}",
        "exec " + shlex.join(run),
        "",
    ]
    return "\n".join(lines)


def submit_slurm(args: argparse.Namespace, sbatch_args: Sequence[str]) -> int:
    """``trainguard submit --slurm``: validate, write the script and the spec's copy under
    ``<state dir>/slurm/``, run ``sbatch``; 0 once Slurm took the job."""

    def fail(message: str, code: int = EXIT_USAGE) -> int:
        print(f"trainguard: {message}", file=sys.stderr)
        return code

    try:
        job = load_job(args.file)
        plan = resolve_plan(job, args.file)
        check_scripts(plan, args.file)
    except SpecError as exc:
        return usage(str(exc))
    if shutil.which("sbatch") is None:
        return fail("submit --slurm: sbatch is not on PATH (is this a Slurm login node?)")
    try:
        store = open_store(args.state_dir)  # made and checked here: the job writes to it
    except StateDirError as exc:
        return fail(str(exc))
    state = store.root
    store.close()
    folder = state / "slurm"
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    spec = folder / f"{plan.name}-{stamp}.yaml"
    shutil.copyfile(args.file, spec)
    script = folder / f"{plan.name}-{stamp}.sbatch"
    script.write_text(batch_script(plan, spec, state, Path.cwd()), encoding="utf-8")
    command = ["sbatch", "--parsable", *sbatch_args, str(script)]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=SBATCH_TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return fail(f"sbatch: {exc}", 1)
    if done.returncode != 0:
        return fail(f"sbatch refused {script}: {(done.stderr or done.stdout).strip()}", 1)
    slurm_id = done.stdout.strip().split(";")[0]
    print(f"Submitted Slurm job {slurm_id} ({script})")
    print(f"trainguard job id once it starts: {plan.name}-slurm{slurm_id}")
    print(f"follow it: trainguard logs --state-dir {state} {plan.name}-slurm{slurm_id} -f")
    return 0
