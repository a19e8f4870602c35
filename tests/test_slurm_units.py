"""The Slurm platform's pure parts: the allocation from Slurm's environment, the command
the other nodes run, the batch script ``submit --slurm`` writes, and its command line.
The real thing runs in tests/test_slurm_platform.py, against a real Slurm."""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path

import pytest

import trainguard.slurm.allocation as allocation
from conftest import SCRIPTS, write_job
from trainguard.cli import _parser, main, parse_command_line
from trainguard.hosts.addresses import JobEndpoint
from trainguard.slurm.allocation import Allocation, SlurmError, spare_count
from trainguard.slurm.run import CONTROLLER_ONLY, daemon_argv
from trainguard.slurm.submit import batch_script
from trainguard.spec import load_job, resolve_plan


@pytest.fixture
def nodelist(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slurm's expansion, without Slurm: ``n[0-2]`` is n0, n1, n2."""
    monkeypatch.setattr(allocation, "expand_nodelist", lambda text, env=None: ("n0", "n1", "n2"))


@pytest.mark.usefixtures("nodelist")
def test_the_batch_script_sees_the_allocation_and_its_requeues() -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[0-2]", "SLURMD_NODENAME": "n0",
           "SLURM_RESTART_COUNT": "2"}  # fmt: skip
    alloc = Allocation.from_env(env)
    assert (alloc.job_id, alloc.nodes, alloc.this_node) == ("7", ("n0", "n1", "n2"), "n0")
    assert alloc.restart_count == 2 and not alloc.in_step


@pytest.mark.usefixtures("nodelist")
def test_a_task_of_srun_on_every_node_knows_its_node() -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[0-2]", "SLURMD_NODENAME": "n2",
           "SLURM_STEP_ID": "0", "SLURM_NODEID": "2", "SLURM_STEP_NUM_NODES": "3"}  # fmt: skip
    alloc = Allocation.from_env(env)
    assert alloc.in_step and (alloc.step_node, alloc.step_nodes) == (2, 3)
    batch = Allocation.from_env({**env, "SLURM_STEP_ID": "batch"})
    assert not batch.in_step


def test_outside_an_allocation_is_an_error_naming_the_variables() -> None:
    with pytest.raises(SlurmError, match="SLURM_JOB_ID and SLURM_JOB_NODELIST"):
        Allocation.from_env({})


def test_the_nodes_beyond_the_job_are_spares() -> None:
    assert spare_count(job_nodes=2, job_spares=0, allocated=3) == 1
    assert spare_count(job_nodes=2, job_spares=1, allocated=2) == 1  # the spec's, if more
    assert spare_count(job_nodes=2, job_spares=0, allocated=2) == 0


def test_the_other_nodes_run_the_same_command_joined_to_the_controller() -> None:
    endpoint, parser = JobEndpoint("10.0.0.1", 4242), _parser()
    spec_form = ["run", "-f", "job.yaml", "--inject", "kill:rank=1@step=5", "--metrics-port=9"]
    assert daemon_argv(spec_form, endpoint, parser) == [
        "run", "-f", "job.yaml", "--rdzv-endpoint", "10.0.0.1:4242"
    ]  # fmt: skip
    torchrun_form = ["--state-dir", "s", "run", "--nproc-per-node", "2", "--inj", "x",
                     "train.py", "--inject", "x"]  # fmt: skip
    assert daemon_argv(torchrun_form, endpoint, parser) == [
        "--state-dir", "s", "run", "--nproc-per-node", "2", "--rdzv-endpoint",
        "10.0.0.1:4242", "train.py", "--inject", "x",
    ]  # fmt: skip


def _value_flags() -> list[tuple[str, str]]:
    """Every option string of ``trainguard run`` that takes a value, with a value its
    parser accepts: read from the parser, so a new flag is covered without a word here."""
    parser, found = _parser(), []
    run = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for action in run.choices["run"]._actions:
        if not action.option_strings or action.nargs == 0:
            continue
        candidates = [str(c) for c in action.choices or ()] or ["1", "10.0.0.1:29500", "V"]
        for option in action.option_strings:
            value = next(v for v in candidates if _parses(parser, [option, v]))
            found.append((option, value))
    return found


def _parses(parser: argparse.ArgumentParser, flag: list[str]) -> bool:
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parser.parse_args(["run", *flag, "train.py"])
    except SystemExit:
        return False
    return True


@pytest.mark.parametrize(("flag", "value"), _value_flags())
@pytest.mark.parametrize("form", ["apart", "attached"])
def test_every_run_flag_that_takes_a_value_keeps_the_script_and_its_arguments(
    flag: str, value: str, form: str
) -> None:
    # `--shutdown-timeout 30 train.py` once lost the script: the flags came from a list
    # kept by hand, which had fallen behind the parser.
    endpoint, parser = JobEndpoint("10.0.0.1", 4242), _parser()
    attached = f"{flag}={value}" if flag.startswith("--") else flag + value
    given = [flag, value] if form == "apart" else [attached]
    argv = ["run", "--nproc-per-node", "1", *given, "train.py", "--lr", flag]
    other = daemon_argv(argv, endpoint, parser)
    assert other[-5:] == ["--rdzv-endpoint", "10.0.0.1:4242", "train.py", "--lr", flag]
    want, got = vars(parser.parse_args(argv)), vars(parser.parse_args(other))
    for dest in CONTROLLER_ONLY:  # the controller's host alone takes these
        want[dest] = parser.parse_args(["run", "train.py"]).__dict__[dest]
    assert got == {**want, "rdzv_endpoint": "10.0.0.1:4242"}


def test_the_batch_script_asks_for_replicas_and_spares_and_keeps_running_on_a_lost_node(
    tmp_path: Path,
) -> None:
    spec = write_job(tmp_path / "job.yaml", "gpt", ["python", str(SCRIPTS / "step_worker.py")])
    job = load_job(spec)
    group = job.spec.replica_specs[0].model_copy(update={"spares": 1})
    job = job.model_copy(update={"spec": job.spec.model_copy(update={"replica_specs": [group]})})
    plan = resolve_plan(job, str(spec))
    state, workdir = tmp_path / "my state", tmp_path / "work"
    text = batch_script(plan, spec, state, workdir, python="/opt/py/bin/python")
    lines = text.splitlines()
    assert lines[0] == "#!/bin/sh"
    for line in ("#SBATCH --job-name=gpt", "#SBATCH --nodes=3", "#SBATCH --no-kill",
                 "#SBATCH --requeue", "#SBATCH --open-mode=append",
                 f"#SBATCH --output={state}/slurm/gpt-%j.out"):  # fmt: skip
        assert line in lines, text
    assert f"export TRAINGUARD_STATE_DIR='{state}'" in lines  # quoted: a space in it
    assert lines[-1] == f"exec /opt/py/bin/python -m trainguard.cli run -f {spec}"


def test_submit_slurm_hands_unknown_options_to_sbatch_and_other_verbs_refuse_them() -> None:
    parser = _parser()
    args = parse_command_line(parser, ["submit", "--slurm", "-f", "job.yaml", "--time=10",
                                       "--partition", "gpu"])  # fmt: skip
    assert args.slurm and args.sbatch_args == ["--time=10", "--partition", "gpu"]
    with pytest.raises(SystemExit) as exited:
        parse_command_line(parser, ["submit", "-f", "job.yaml", "--time=10"])
    assert exited.value.code == 2


def test_submit_slurm_checks_the_spec_before_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = write_job(tmp_path / "job.yaml", "gpt", [sys.executable, "missing_script.py"])
    code = main(["submit", "--slurm", "-f", str(spec), "--state-dir", str(tmp_path / "s")])
    assert code == 2
    assert "missing_script.py" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()  # nothing written for a job that cannot run
