"""hyperpodrun's own flags: parsed from launcher lines and `trainguard run`, mapped onto
spec.trainguard, and honoured by the node agents (pre/post-train scripts, the stop's
signal)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import Trainguard, write_job
from trainguard.agent.train_scripts import TrainScripts, parse_script_flag, run_train_script
from trainguard.platform.control_config import control_config
from trainguard.spec import SpecError, TrainingJob, parse_job, resolve_plan
from trainguard.spec.launcher import LauncherError, parse_launcher

CMD = "spec.replicaSpecs[0].template.spec.containers[0].command"


def _job(command: list[str], trainguard: dict[str, Any] | None = None) -> TrainingJob:
    spec: dict[str, Any] = {
        "replicaSpecs": [
            {"name": "w", "template": {"spec": {"containers": [{"name": "c", "command": command}]}}}
        ]
    }
    if trainguard is not None:
        spec["trainguard"] = trainguard
    data = {"apiVersion": "trainguard.dev/v1", "kind": "TrainingJob",
            "metadata": {"name": "j"}, "spec": spec}  # fmt: skip
    return parse_job(data, "job.yaml")


def test_launcher_line_flags_become_options() -> None:
    line = [
        "hyperpodrun", "--pre-train-script=/w/pre.sh", "--pre-train-args=a 'b c'",
        "--post-train-script", "/w/post.sh", "--shutdown-signal=SIGTERM",
        "--shutdown-timeout=30", "--inprocess-restart", "--inprocess-timeout=45",
        "--server-port=8080", "/w/train.py",
    ]  # fmt: skip
    plan = resolve_plan(_job(line), "job.yaml")
    options = plan.job.spec.trainguard
    assert options.pre_train_script == ["/w/pre.sh", "a", "b c"]
    assert options.post_train_script == ["/w/post.sh"]
    assert (options.shutdown_signal, plan.stop_grace_seconds) == ("SIGTERM", 30.0)
    assert options.in_process_restart and options.restart_barrier_timeout_seconds == 45.0
    assert plan.groups[0].ignored_flags == ("--server-port",)
    assert plan.groups[0].command[-1] == "/w/train.py"


def test_sigkill_stops_at_once_and_unset_flags_keep_the_spec() -> None:
    plan = resolve_plan(_job(["hyperpodrun", "--shutdown-signal", "SIGKILL", "t.py"]), "j")
    assert plan.stop_grace_seconds == 0.0
    assert not control_config(plan, "j", durable=False)[0].graceful_fault_stops
    plan = resolve_plan(_job(["hyperpodrun", "--shutdown-signal", "SIGTERM", "t.py"]), "j")
    assert control_config(plan, "j", durable=False)[
        0
    ].graceful_fault_stops  # a fault's stop: SIGTERM too
    plan = resolve_plan(_job(["hyperpodrun", "t.py"], {"stopGracePeriodSeconds": 7}), "j")
    assert (plan.job.spec.trainguard.shutdown_signal, plan.stop_grace_seconds) == (None, 7)
    assert not control_config(plan, "j", durable=False)[
        0
    ].graceful_fault_stops  # trainguard's own way


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["hyperpodrun", "--shutdown-signal=SIGINT", "t.py"], "expected SIGTERM or SIGKILL"),
        (["hyperpodrun", "--pre-train-args=x", "t.py"], "--pre-train-args needs"),
        (["hyperpodrun", "--inprocess-timeout=soon", "t.py"], "expected a number of seconds"),
        (["torchrun", "--pre-train-script=p.sh", "t.py"], "unrecognized arguments"),
    ],
)
def test_bad_flags(argv: list[str], message: str) -> None:
    with pytest.raises(LauncherError, match=message):
        parse_launcher(argv)


def test_flags_that_disagree_with_the_spec_are_refused() -> None:
    job = _job(["hyperpodrun", "--shutdown-timeout=5", "t.py"], {"stopGracePeriodSeconds": 9})
    with pytest.raises(SpecError, match="--shutdown-timeout disagrees with"):
        resolve_plan(job, "job.yaml")
    with pytest.raises(SpecError, match="--inprocess-timeout: "):
        resolve_plan(_job(["hyperpodrun", "--inprocess-timeout=0", "t.py"]), "job.yaml")


def test_scripts_reach_the_agent_and_failures_carry_the_output(tmp_path: Path) -> None:
    flags = TrainScripts(pre=("a", "b c"), post=("d",)).agent_flags()
    assert flags[0] == "--pre-train-script" and parse_script_flag(flags[1]) == ("a", "b c")
    assert flags[2:] == ["--post-train-script", '["d"]']
    with pytest.raises(ValueError, match="non-empty JSON list"):
        parse_script_flag("[]")
    code = "import sys; print('line 1'); print('quota exceeded'); sys.exit(4)"
    log = tmp_path / "n0-pre-train.log"
    message = run_train_script("pre-train", [sys.executable, "-c", code], {}, None, log)
    assert message is not None and "exited with 4" in message
    assert message.endswith("line 1\nquota exceeded") and "quota" in log.read_text()
    ok = run_train_script("post-train", [sys.executable, "-c", "pass"], {}, tmp_path, log)
    assert ok is None
    missing = run_train_script("pre-train", [str(tmp_path / "nope")], {}, None, log)
    assert missing is not None and "could not start" in missing


# -- end to end --------------------------------------------------------------------------

_NODE = "os.path.basename(os.path.dirname(os.environ['TRAINGUARD_CHECKPOINT_MEMORY_DIR']))"
_PRE = f"""#!{sys.executable}
import os, sys
with open(os.path.join(sys.argv[1], "pre-" + {_NODE}), "a") as f:
    f.write("ran\\n")
"""
# Counts its node's pre-train runs at its start; rank 1 fails attempt 0, and rank 0 (asleep)
# is stopped: its SIGTERM handler leaves a file.
_WORKER = f"""import os, signal, sys, time
out = sys.argv[1]
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
pre = os.path.join(out, "pre-" + {_NODE})
runs = len(open(pre).read().splitlines()) if os.path.exists(pre) else 0
open(os.path.join(out, f"saw-{{rank}}-{{attempt}}"), "w").write(str(runs))
def on_term(*_):
    open(os.path.join(out, f"term-{{rank}}-{{attempt}}"), "w").write("x")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
if attempt == 0:
    if rank == 1:
        time.sleep(1)
        sys.exit(3)
    time.sleep(120)
"""


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.mark.e2e
def test_pre_train_runs_before_workers_and_sigterm_reaches_them(
    tg: Trainguard, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    pre = _script(tmp_path / "pre.py", _PRE)
    worker = _script(tmp_path / "worker.py", _WORKER)
    result = tg.run(
        "run", "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "1",
        "--pre-train-script", str(pre), "--pre-train-args", str(out),
        "--shutdown-signal", "SIGTERM", "--shutdown-timeout", "20",
        str(worker), str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    saw = {p.name: int(p.read_text()) for p in out.glob("saw-*")}
    assert saw["saw-0-0"] == 1 and saw["saw-1-0"] == 1  # each node ran it before its worker
    assert saw["saw-0-1"] == 2 and saw["saw-1-1"] == 2  # and again before the restart's
    assert (out / "term-0-0").exists()  # the stop's SIGTERM ran rank 0's handler


@pytest.mark.e2e
def test_failing_post_train_script_in_a_launcher_line_is_a_fault(
    tg: Trainguard, tmp_path: Path
) -> None:
    post = _script(
        tmp_path / "post.sh",
        "#!/bin/sh\necho uploading checkpoints\necho 'quota exceeded'\nexit 7\n",
    )
    line = [
        "hyperpodrun", "--post-train-script", str(post), "--shutdown-signal=SIGKILL",
        "--nnodes=2", "--nproc-per-node=2", "--no-python", sys.executable, "-c", "pass",
    ]  # fmt: skip
    spec = write_job(tmp_path / "job.yaml", "post", line, runPolicy={"jobMaxRetryCount": 0})
    result = tg.run("run", "-f", str(spec))
    assert result.returncode != 0
    assert "post-train script" in result.stderr and "exited with 7" in result.stderr
    assert "quota exceeded" in result.stderr
