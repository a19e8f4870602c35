"""Bounds on everything a spec brings in: huge counts, infinite durations, alias bombs,
huge files and a bad --state-dir are exit 2 with one line naming the field or the file,
quickly and without the memory they would otherwise take."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from test_spec_model import errors_of, job_with
from trainguard.cli import main
from trainguard.spec import SpecError, load_job, parse_job, resolve_plan
from trainguard.spec.limits import (
    MAX_LOCAL_NODES,
    MAX_LOCAL_NODES_ENV,
    MAX_NODES,
    MAX_SPEC_SIZE,
    MAX_TEMPLATE_SIZE,
)
from trainguard.spec.plan import check_local_size

REPO = Path(__file__).resolve().parent.parent
MINIMAL = job_with(**{"metadata.name": "bounds"})


def error_of(data: object) -> str:
    return errors_of(data)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], float]:
    """(exit code, stderr lines, seconds) of `trainguard ARGV` run in this process."""
    start = time.monotonic()
    code = main(list(argv))
    took = time.monotonic() - start
    return code, capsys.readouterr().err.splitlines(), took


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# --- the audit's rows, through the CLI ---------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "line"),
    [
        (
            "spec.replicaSpecs.0.replicas",
            1_000_000_000_000,
            "spec.replicaSpecs[0].replicas: must be <= 65536",
        ),
        (
            "spec.trainguard.pollIntervalSeconds",
            "1e308",  # YAML 1.1 reads 1e308 (no dot) as a string; pydantic as a number
            "spec.trainguard.pollIntervalSeconds: must be <= 60",
        ),
        (
            "spec.trainguard.stopGracePeriodSeconds",
            float("inf"),  # .inf in YAML
            "spec.trainguard.stopGracePeriodSeconds: must be a finite number",
        ),
    ],
)
def test_huge_count_or_infinite_duration_is_exit_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, value: object, line: str
) -> None:
    spec = write(tmp_path / "job.yaml", yaml.safe_dump(job_with(**{field: value})))
    assert (".inf" in spec.read_text()) == (value == float("inf"))
    code, err, _ = run_cli(capsys, "run", "--state-dir", str(tmp_path / "state"), "-f", str(spec))
    assert code == 2
    assert err == [f"trainguard: {spec}: {line}"]
    assert not (tmp_path / "state").exists()  # refused before anything was recorded


BILLION_LAUGHS = """\
apiVersion: trainguard.dev/v1
kind: TrainingJob
metadata: {name: laughs}
spec:
  replicaSpecs:
    - name: worker
      template:
        metadata:
          annotations:
            a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
            b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
            c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
            d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
            e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
            f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
            g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
            h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
            i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
        spec:
          containers: [{name: c, command: [python, t.py]}]
"""


def _limit_memory() -> None:  # in the child: 2 GiB of address space (a bomb needs ~50)
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def test_alias_bomb_in_the_pod_template_is_exit_2_in_little_memory(tmp_path: Path) -> None:
    spec = write(tmp_path / "laughs.yaml", BILLION_LAUGHS)
    state = tmp_path / "state"
    done = subprocess.run(
        [sys.executable, "-m", "trainguard.cli", "run", "--state-dir", str(state), "-f", str(spec)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        preexec_fn=_limit_memory,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"trainguard: {spec}: spec.replicaSpecs[0].template.metadata.annotations.g: larger "
        "than 4 MiB as JSON, with its YAML aliases expanded (an alias bomb?)"
    ]
    assert not state.exists()


def test_alias_bomb_is_refused_by_load_job_too() -> None:
    """The same check holds for `submit` and the operator (parse_job of shared data)."""
    laughs: list[object] = ["lol"] * 9
    for _ in range(8):
        laughs = [laughs] * 9
    data = job_with(**{"spec.replicaSpecs.0.template.metadata": {"x": laughs}})
    assert "alias bomb" in error_of(data)


def test_20_mb_spec_is_exit_2_before_it_is_parsed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = write(tmp_path / "big.yaml", yaml.safe_dump(MINIMAL) + "# " + "x" * (20 << 20))
    code, err, _ = run_cli(capsys, "run", "--state-dir", str(tmp_path / "state"), "-f", str(spec))
    assert code == 2
    assert err == [f"trainguard: {spec}: larger than 1 MiB, the most a job spec may be"]


def test_an_endless_file_is_read_no_further_than_the_limit() -> None:
    with pytest.raises(SpecError, match="larger than 1 MiB"):
        load_job("/dev/zero")


@pytest.mark.parametrize("verb", [["run", "-f", "job.yaml"], ["list"], ["describe", "x"]])
def test_state_dir_that_is_a_file_is_exit_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], verb: list[str]
) -> None:
    write(tmp_path / "job.yaml", yaml.safe_dump(MINIMAL))
    verb = [str(tmp_path / arg) if arg == "job.yaml" else arg for arg in verb]
    not_a_dir = write(tmp_path / "state", "")
    code, err, _ = run_cli(capsys, verb[0], "--state-dir", str(not_a_dir), *verb[1:])
    assert code == 2
    assert err == [f"trainguard: --state-dir {not_a_dir}: is a file, not a directory"]


def test_state_dir_under_a_file_is_exit_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    under = write(tmp_path / "file", "") / "state"
    monkeypatch.setenv("TRAINGUARD_STATE_DIR", str(under))
    code, err, _ = run_cli(capsys, "list")
    assert code == 2
    assert err == [f"trainguard: $TRAINGUARD_STATE_DIR {under}: cannot create it: Not a directory"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_state_dir_not_writable_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = write(tmp_path / "job.yaml", yaml.safe_dump(MINIMAL))
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    code, err, _ = run_cli(capsys, "run", "--state-dir", str(locked), "-f", str(spec))
    assert code == 2
    assert err == [f"trainguard: --state-dir {locked}: not writable"]


# --- every count and duration has a bound ------------------------------------------------


@pytest.mark.parametrize(
    ("field", "bad", "message"),
    [
        ("spec.replicaSpecs.0.spares", MAX_NODES + 1, "must be <= 65536"),
        ("spec.replicaSpecs.0.maxReplicas", 10**12, "must be <= 65536"),
        ("spec.nprocPerNode", 10**12, "must be <= 1024"),
        ("spec.nprocPerNode", "99999999999999999999", "must be <= 1024"),
        pytest.param("spec.nprocPerNode", 10**5000, "must be <= 1024", id="nproc-5000-digits"),
        ("spec.runPolicy.jobMaxRetryCount", 10**12, "must be <= 100000"),
        ("spec.runPolicy.restartPolicy.maxFullJobRestarts", 10**12, "must be <= 100000"),
        ("spec.elasticPolicy.maxReplicas", 10**9, "must be <= 65536"),
        ("spec.elasticPolicy.replicaDiscreteValues", [10**9], "must be <= 65536"),
        ("spec.trainguard.hotSpares", 10**9, "must be <= 1024"),
        ("spec.checkpointing.memoryKeep", 10**9, "must be <= 100"),
        ("spec.checkpointing.durableKeep", 10**9, "must be <= 100000"),
        ("spec.checkpointing.replicas", 10**9, "must be <= 64"),
        ("spec.checkpointing.memoryEverySteps", 10**12, "must be <= 1000000000"),
        ("spec.runPolicy.activeDeadlineSeconds", 1e12, "must be <= 31622400"),
        ("spec.runPolicy.activeDeadlineSeconds", float("nan"), "must be a finite number"),
        ("spec.runPolicy.ttlSecondsAfterFinished", float("inf"), "must be a finite number"),
        ("spec.trainguard.nodeStartTimeoutSeconds", float("inf"), "must be a finite number"),
        ("spec.trainguard.heartbeatTimeoutSeconds", 1e308, "must be <= 31622400"),
        ("spec.trainguard.stopGracePeriodSeconds", 86_400, "must be <= 3600"),
        ("spec.trainguard.stragglerThreshold", 1e300, "must be <= 1000"),
        ("spec.checkpointing.durableEverySeconds", float("-inf"), "must be a finite number"),
        ("spec.elasticPolicy.scalingTimeoutInSeconds", float("inf"), "must be a finite number"),
    ],
)
def test_each_count_and_duration_has_a_bound(field: str, bad: object, message: str) -> None:
    data = job_with(**{field: bad})
    if field.startswith("spec.runPolicy.restartPolicy."):
        data["spec"]["runPolicy"]["restartPolicy"]["evalPeriodSeconds"] = 60
    path = field.replace(".0.", "[0].")
    if field.endswith("replicaDiscreteValues"):
        path += "[0]"
    assert error_of(data) == f"job.yaml: {path}: {message}"


def test_many_groups_add_up_to_at_most_max_nodes() -> None:
    group = MINIMAL["spec"]["replicaSpecs"][0]
    groups = [{**group, "name": f"g{i}", "replicas": MAX_NODES} for i in range(2)]
    assert error_of(job_with(**{"spec.replicaSpecs": groups})) == (
        "job.yaml: spec.replicaSpecs: 131072 nodes with spares; a job has at most 65536"
    )


def test_log_rules_are_bounded_in_number() -> None:
    rules = [{"name": f"r{i}", "logPattern": "x"} for i in range(101)]
    assert error_of(job_with(**{"spec.runPolicy.logMonitoringConfiguration": rules})) == (
        "job.yaml: spec.runPolicy.logMonitoringConfiguration: must have at most 100 item(s)"
    )


def test_world_size_is_bounded() -> None:
    job = parse_job(
        job_with(**{"spec.replicaSpecs.0.replicas": MAX_NODES, "spec.nprocPerNode": 1024}), "j"
    )
    with pytest.raises(SpecError, match=r"spec.nprocPerNode: 67108864 ranks in all"):
        resolve_plan(job, "j")


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--nnodes=1000000000000", "--nnodes=1000000000000: at most 65536"),
        ("--nproc-per-node=100000", "--nproc-per-node=100000: at most 1024"),
        ("--max-restarts=1000000000", "--max-restarts=1000000000: at most 100000"),
    ],
)
def test_launcher_line_counts_are_bounded(flag: str, message: str) -> None:
    command = ["torchrun", flag, "train.py"]
    job = parse_job(
        job_with(**{"spec.replicaSpecs.0.template.spec.containers.0.command": command}), "j"
    )
    with pytest.raises(SpecError) as info:
        resolve_plan(job, "j")
    assert str(info.value) == (
        f"j: spec.replicaSpecs[0].template.spec.containers[0].command: {message}"
    )


def test_env_expansion_bomb_is_refused() -> None:
    """Each $(VAR) doubling the one before: 40 variables would make a terabyte."""
    env = [{"name": "V0", "value": "x" * 64}]
    env += [{"name": f"V{i}", "value": f"$(V{i - 1})$(V{i - 1})"} for i in range(1, 40)]
    container = {"name": "c", "command": ["python", "t.py"], "env": env}
    job = parse_job(job_with(**{"spec.replicaSpecs.0.template.spec.containers": [container]}), "j")
    with pytest.raises(SpecError) as info:
        resolve_plan(job, "j")
    assert str(info.value) == (
        "j: spec.replicaSpecs[0].template.spec.containers[0]: $(V10): longer than 128 KiB "
        "once $(VAR) references are expanded"
    )


def test_template_size_is_bounded() -> None:
    args = ["a" * 1000] * (MAX_TEMPLATE_SIZE // 1000)
    container = {"name": "c", "command": ["python", "t.py"], "args": args}
    data = job_with(**{"spec.replicaSpecs.0.template.spec.containers": [container]})
    assert error_of(data) == (
        "job.yaml: spec.replicaSpecs[0].template: larger than 512 KiB as JSON"
    )


def test_document_size_and_depth_are_bounded() -> None:
    labels = {f"k{i}": "v" * 1000 for i in range(MAX_SPEC_SIZE // 1000)}
    assert "metadata.labels: larger than 4 MiB" in error_of(job_with(**{"metadata.labels": labels}))
    deep: list[object] = []
    for _ in range(100):
        deep = [deep]
    assert error_of(job_with(**{"metadata.labels": deep})) == (
        "job.yaml: nested more than 64 levels deep"
    )


def test_deep_or_huge_yaml_scalars_are_clean_errors(tmp_path: Path) -> None:
    deep = write(tmp_path / "deep.yaml", "a: " + "[" * 1000 + "]" * 1000 + "\n")
    with pytest.raises(SpecError, match="nested more than 64 levels deep"):
        load_job(deep)
    digits = write(tmp_path / "digits.yaml", "a: " + "9" * 5000 + "\n")
    with pytest.raises(SpecError, match="invalid YAML"):
        load_job(digits)


# --- one machine -------------------------------------------------------------------------


def test_a_local_run_refuses_more_nodes_than_one_machine_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write(tmp_path / "t.py", "")
    code, err, _ = run_cli(
        capsys, "run", "--state-dir", str(tmp_path / "state"), "--nnodes", "2000", str(script)
    )
    assert code == 2
    assert err == [
        "trainguard: command line: --nnodes: 2000 nodes is more than one machine runs: at most "
        f"{MAX_LOCAL_NODES} locally, each an agent process of about 0.6 GB; set "
        f"{MAX_LOCAL_NODES_ENV} to raise the limit"
    ]


def test_the_local_limit_is_raised_by_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    data = job_with(**{"spec.replicaSpecs.0.replicas": 100, "spec.replicaSpecs.0.spares": 1})
    plan = resolve_plan(parse_job(data, "job.yaml"), "job.yaml")
    with pytest.raises(SpecError, match=r"spec.replicaSpecs: 101 nodes \(spares included\)"):
        check_local_size(plan, "job.yaml")
    monkeypatch.setenv(MAX_LOCAL_NODES_ENV, "128")
    check_local_size(plan, "job.yaml")
    workers = job_with(**{"spec.replicaSpecs.0.replicas": 2, "spec.nprocPerNode": 1000})
    with pytest.raises(SpecError, match=r"spec.nprocPerNode: 2000 worker processes"):
        check_local_size(resolve_plan(parse_job(workers, "j"), "j"), "j")
