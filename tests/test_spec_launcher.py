"""Launcher lines: torchrun, hyperpodrun and python -m torch.distributed.run."""

from __future__ import annotations

import pytest

from trainguard.spec import LauncherError, parse_launcher


@pytest.mark.parametrize(
    "prefix",
    [
        ["torchrun"],
        ["/opt/conda/bin/torchrun"],
        ["hyperpodrun"],
        ["python", "-m", "torch.distributed.run"],
        ["python3", "-m", "torch.distributed.run"],
        ["python3.11", "-u", "-m", "torch.distributed.run"],
        ["python", "-mtorch.distributed.run"],
    ],
)
def test_launcher_forms_are_recognised(prefix: list[str]) -> None:
    line = parse_launcher([*prefix, "--nnodes=2", "--nproc-per-node", "4", "train.py", "--lr", "1"])
    assert line is not None
    assert (line.nnodes, line.nproc_per_node, line.max_restarts) == (2, "4", None)
    assert (line.script, line.script_args) == ("train.py", ("--lr", "1"))
    assert not line.module and not line.no_python


@pytest.mark.parametrize(
    "argv",
    [
        ["python", "train.py"],
        ["python", "-m", "pkg.train"],
        ["bash", "-c", "torchrun x.py"],
        ["torchrun-like", "x.py"],
        [],
    ],
)
def test_other_commands_are_not_launchers(argv: list[str]) -> None:
    assert parse_launcher(argv) is None


@pytest.mark.parametrize(
    "flags",
    [
        ["--nproc_per_node=2", "--max_restarts=3"],
        ["--nproc-per-node=2", "--max-restarts", "3"],
        ["--nproc_per_node", "2", "--max-restarts=3"],
    ],
)
def test_both_spellings_and_value_styles(flags: list[str]) -> None:
    line = parse_launcher(["torchrun", *flags, "t.py"])
    assert line is not None
    assert (line.nproc_per_node, line.max_restarts) == ("2", 3)


def test_script_arguments_that_look_like_launcher_flags_belong_to_the_script() -> None:
    line = parse_launcher(["torchrun", "--nnodes", "1", "t.py", "--nnodes", "3", "-m"])
    assert line is not None
    assert line.nnodes == 1
    assert line.script_args == ("--nnodes", "3", "-m")
    assert not line.module


def test_module_and_no_python() -> None:
    line = parse_launcher(["torchrun", "-m", "pkg.train", "--x"])
    assert line is not None and line.module and line.script == "pkg.train"
    line = parse_launcher(["torchrun", "--no-python", "./run.sh", "a"])
    assert line is not None and line.no_python and line.script == "./run.sh"
    line = parse_launcher(["torchrun", "--no_python", "--run-path", "/abs/t.py"])
    assert line is not None and not line.no_python  # --run-path wins, as in torchrun
    with pytest.raises(LauncherError, match="--no-python and -m/--module"):
        parse_launcher(["torchrun", "-m", "--no-python", "x"])


def test_nnodes_range_must_be_fixed() -> None:
    line = parse_launcher(["torchrun", "--nnodes=3:3", "t.py"])
    assert line is not None and line.nnodes == 3
    with pytest.raises(LauncherError, match="MIN must equal MAX"):
        parse_launcher(["torchrun", "--nnodes=1:4", "t.py"])
    with pytest.raises(LauncherError, match="expected N or MIN:MAX"):
        parse_launcher(["torchrun", "--nnodes=two", "t.py"])


def test_flags_trainguard_decides_are_reported_as_ignored() -> None:
    line = parse_launcher(
        [
            "torchrun",
            "--standalone",
            "--rdzv_backend=c10d",
            "--rdzv-endpoint",
            "host:29400",
            "--rdzv-id=7",
            "--node_rank=0",
            "--master-addr=10.0.0.1",
            "--master_port=29500",
            "--tee=3",
            "-r",
            "3",
            "--log-dir=/tmp/l",
            "--local-ranks-filter=0",
            "--monitor-interval=1",
            "--role=trainer",
            "t.py",
        ]
    )
    assert line is not None
    assert set(line.ignored) == {
        "--standalone",
        "--rdzv-backend",
        "--rdzv-endpoint",
        "--rdzv-id",
        "--node-rank",
        "--master-addr",
        "--master-port",
        "--tee",
        "--redirects",
        "--log-dir",
        "--local-ranks-filter",
        "--monitor-interval",
        "--role",
    }
    assert line.script == "t.py" and line.script_args == ()


def test_hyperpodrun_extras() -> None:
    line = parse_launcher(
        [
            "hyperpodrun",
            "--inprocess-restart",
            "--inprocess-timeout=30",
            "--shutdown-signal=SIGTERM",
            "--shutdown-timeout",
            "15",
            "--server-host=0.0.0.0",
            "--server-port=8080",
            "--pre-train-script=/w/pre.sh",
            "--pre-train-args=a b",
            "--post-train-script=/w/post.sh",
            "--nnodes=2",
            "--nproc-per-node=gpu",
            "/w/train.py",
        ]
    )
    assert line is not None
    assert (line.launcher, line.nnodes, line.nproc_per_node) == ("hyperpodrun", 2, "gpu")
    assert set(line.ignored) == {"--server-host", "--server-port"}
    assert line.hyperpod.inprocess_restart and line.hyperpod.shutdown_signal == "SIGTERM"
    assert line.hyperpod.pre_train == ("/w/pre.sh", "a", "b")


def test_hyperpodrun_flags_are_not_torchrun_flags() -> None:
    with pytest.raises(LauncherError, match="unrecognized arguments: --server-port=1"):
        parse_launcher(["torchrun", "--server-port=1", "t.py"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["torchrun"], "missing the training script"),
        (["torchrun", "--nnodes"], "expected one argument"),
        (["torchrun", "--bogus", "t.py"], "unrecognized arguments: --bogus"),
        (["torchrun", "--nproc-per-node=0", "t.py"], "expected auto, cpu, gpu or a positive"),
        (["torchrun", "--max-restarts=-1", "t.py"], "expected an integer >= 0"),
        (["torchrun", "--nproc", "2", "t.py"], "unrecognized arguments"),
    ],
)
def test_bad_launcher_lines(argv: list[str], message: str) -> None:
    with pytest.raises(LauncherError, match=message):
        parse_launcher(argv)
