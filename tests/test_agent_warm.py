"""Warm starts: a worker forked from the template behaves as ``python -u SCRIPT`` would."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import pid_alive, wait_for
from trainguard.agent.preload import WarmCommand, imported_names, warm_command
from trainguard.agent.warm import Process, Spawner, StartOptions

PY = sys.executable

PROBE = textwrap.dedent(
    """
    import atexit, json, os, random, sys, threading, time
    import localmod
    print("unbuffered line")  # no flush: -u must make it visible at once
    facts = {
        "name": __name__, "file": __file__, "argv": sys.argv, "path0": sys.path[0],
        "cwd": os.getcwd(), "env": {k: os.environ.get(k) for k in ("ONLY_WORKER", "ONLY_TEMPLATE")},
        "session_leader": os.getsid(0) == os.getpid(), "random": random.random(),
        "main_is_us": sys.modules["__main__"].__dict__ is globals(),
        "localmod_imports": localmod.IMPORTS,
    }
    with open(os.environ["FACTS"], "w") as f:
        json.dump(facts, f)
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "raise":
        raise RuntimeError("boom from the script")
    if mode == "exit":
        sys.exit(int(sys.argv[2]))
    if mode == "message":
        sys.exit("leaving with a message")
    if mode == "sleep":
        time.sleep(600)
    if mode == "shutdown":
        atexit.register(lambda: print("atexit ran", flush=True))
        late = lambda: (time.sleep(0.3), print("thread joined", flush=True))
        threading.Thread(target=late).start()
    """
)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "probe.py").write_text(PROBE)
    # A module of the user's own: the template must leave it to the worker (it could read
    # the rank's environment when imported), so each worker imports it itself.
    (tmp_path / "localmod.py").write_text(
        "import os\nIMPORTS = os.environ.get('IMPORTS_SEEN', '0')\n"
        "with open(os.path.join(os.path.dirname(__file__), 'imported-by'), 'a') as f:\n"
        "    f.write(str(os.getpid()) + '\\n')\n"
    )
    return tmp_path


@pytest.fixture
def spawner(workdir: Path) -> Iterator[Spawner]:
    s = Spawner(
        [PY, "-u", str(workdir / "probe.py")],
        {"ONLY_TEMPLATE": "template"},
        workdir,
        workdir / "template.log",
    )
    yield s
    s.close()


def fork(spawner: Spawner, workdir: Path, name: str, *args: str) -> tuple[Process, Path]:
    env = {**os.environ, "ONLY_WORKER": name, "FACTS": str(workdir / f"{name}.json")}
    env.pop("ONLY_TEMPLATE", None)
    out = workdir / name
    proc = spawner.spawn(
        [PY, "-u", str(workdir / "probe.py"), *args],
        env,
        out.with_suffix(".out"),
        out.with_suffix(".err"),
    )
    assert proc is not None, (workdir / "template.log").read_text()
    return proc, out


def facts(workdir: Path, name: str) -> dict[str, object]:
    result: dict[str, object] = json.loads((workdir / f"{name}.json").read_text())
    return result


def test_warm_command_takes_only_plain_python() -> None:
    assert warm_command([PY, "-u", "train.py", "--lr", "1"]) == WarmCommand(
        "train.py", False, ("--lr", "1"), True
    )
    assert warm_command([PY, "-m", "pkg.train", "-x"]) == WarmCommand(
        "pkg.train", True, ("-x",), False
    )
    for argv in (
        [PY, "-X", "dev", "train.py"],
        [PY, "-c", "print(1)"],
        [PY, "-m"],
        [PY],
        ["/bin/echo", "train.py"],
        ["./train.sh"],
    ):
        assert warm_command(argv) is None, argv


def test_imported_names_reads_every_import_once() -> None:
    source = (
        "import torch.nn as nn\nfrom numpy import x\nfrom . import sib\ndef f():\n import torch\n"
    )
    assert imported_names(source) == ["torch.nn", "numpy", "numpy.x", "torch"]
    assert imported_names("this is not python(") == []


def test_a_forked_worker_looks_like_a_fresh_interpreter(spawner: Spawner, workdir: Path) -> None:
    first, out = fork(spawner, workdir, "a", "--flag")
    second, _ = fork(spawner, workdir, "b")
    assert first.wait(60) == 0 and second.wait(60) == 0
    a, b = facts(workdir, "a"), facts(workdir, "b")
    script = str(workdir / "probe.py")
    assert a["name"] == "__main__" and a["main_is_us"] is True
    assert a["file"] == script and a["argv"] == [script, "--flag"]
    assert a["path0"] == os.path.realpath(workdir) and a["cwd"] == str(workdir)
    assert a["env"] == {"ONLY_WORKER": "a", "ONLY_TEMPLATE": None}
    assert a["session_leader"] is True
    assert a["random"] != b["random"]  # each worker is seeded anew, as fresh ones are
    assert out.with_suffix(".out").read_text() == "unbuffered line\n"
    # The user's own module was imported by each worker, not by the template.
    importers = (workdir / "imported-by").read_text().split()
    assert sorted(importers) == sorted([str(first.pid), str(second.pid)])
    assert spawner.template is not None and "localmod" not in spawner.template.preloaded
    assert "json" in spawner.template.preloaded


def test_exit_codes_and_tracebacks_are_the_interpreters(spawner: Spawner, workdir: Path) -> None:
    raised, raised_out = fork(spawner, workdir, "raise", "raise")
    exited, _ = fork(spawner, workdir, "exit", "exit", "7")
    message, message_out = fork(spawner, workdir, "message", "message")
    assert raised.wait(60) == 1
    assert exited.wait(60) == 7
    assert message.wait(60) == 1
    err = raised_out.with_suffix(".err").read_text()
    assert "RuntimeError: boom from the script" in err
    assert 'File "' + str(workdir / "probe.py") in err
    assert "template.py" not in err  # the traceback starts at the script, as python's does
    assert "leaving with a message" in message_out.with_suffix(".err").read_text()


def test_atexit_and_threads_run_at_exit(spawner: Spawner, workdir: Path) -> None:
    proc, out = fork(spawner, workdir, "shutdown", "shutdown")
    assert proc.wait(60) == 0
    assert out.with_suffix(".out").read_text().splitlines()[1:] == ["thread joined", "atexit ran"]


def test_a_killed_worker_reports_the_signal(spawner: Spawner, workdir: Path) -> None:
    proc, _ = fork(spawner, workdir, "sleeper", "sleep")
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)  # the worker leads its own process group
    assert proc.wait(60) == -signal.SIGKILL


def test_workers_die_with_the_template_and_later_starts_are_fresh(
    spawner: Spawner, workdir: Path
) -> None:
    proc, _ = fork(spawner, workdir, "orphan", "sleep")
    assert spawner.template is not None
    os.kill(spawner.template.pid, signal.SIGKILL)
    assert proc.wait(60) == -signal.SIGKILL
    wait_for(lambda: not pid_alive(proc.pid))
    env = {**os.environ, "FACTS": str(workdir / "late.json")}
    paths = workdir / "late.out", workdir / "late.err"
    assert spawner.spawn([PY, "-u", str(workdir / "probe.py")], env, *paths) is None


def test_modules_run_with_dash_m(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(
        "import os, sys\nprint(__name__, __spec__.name, sys.argv[1:], sys.path[0] == os.getcwd())\n"
    )
    argv = [PY, "-u", "-m", "pkg.train", "x"]
    spawner = Spawner(argv, {}, tmp_path, tmp_path / "template.log")
    try:
        proc = spawner.spawn(argv, dict(os.environ), tmp_path / "out", tmp_path / "err")
        assert proc is not None
        assert proc.wait(60) == 0, (tmp_path / "err").read_text()
    finally:
        spawner.close()
    assert (tmp_path / "out").read_text() == "__main__ pkg.train ['x'] True\n"


def test_fresh_starts_when_warm_ones_cannot_be(tmp_path: Path) -> None:
    off = Spawner([PY, "x.py"], {}, tmp_path, tmp_path / "t.log", StartOptions(warm=False))
    not_python = Spawner(["/bin/true"], {}, tmp_path, tmp_path / "t.log")
    assert off.template is None and "warmStart" in (off.why_cold or "")
    assert not_python.template is None and "not `python" in (not_python.why_cold or "")
    assert off.spawn([PY, "x.py"], {}, tmp_path / "o", tmp_path / "e") is None


def test_a_template_with_python_threads_is_not_used(tmp_path: Path) -> None:
    (tmp_path / "threader.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    )
    (tmp_path / "script.py").write_text("print('hi')\n")
    argv = [PY, str(tmp_path / "script.py")]
    spawner = Spawner(
        argv,
        {"PYTHONPATH": str(tmp_path)},
        tmp_path,
        tmp_path / "t.log",
        StartOptions(preload=("threader",)),
    )
    try:
        assert spawner.spawn(argv, dict(os.environ), tmp_path / "o", tmp_path / "e") is None
        assert spawner.template is not None
        assert "threads" in (spawner.template.why_not or "")
        assert "no worker template: " in (tmp_path / "t.log").read_text()  # said where looked
    finally:
        spawner.close()


def test_every_worker_is_forked_by_the_one_template(spawner: Spawner, workdir: Path) -> None:
    sleepers = [fork(spawner, workdir, f"n{n}", "sleep")[0] for n in range(3)]
    assert spawner.template is not None
    # Its readiness is in its log (logs/template-node-N.log), where the docs say it is.
    assert "worker template ready in " in (workdir / "template.log").read_text()
    for proc in sleepers:
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
        assert int(stat.rsplit(")", 1)[1].split()[1]) == spawner.template.pid  # its ppid
        os.killpg(proc.pid, signal.SIGKILL)
    assert [p.wait(60) for p in sleepers] == [-signal.SIGKILL] * 3


def test_a_worker_forked_after_torch_gets_its_own_thread_count(tmp_path: Path) -> None:
    """The template imported torch without OMP_NUM_THREADS; a worker that has it set runs
    that many intra-op threads, as a fresh interpreter would (oversubscribed otherwise)."""
    script = tmp_path / "threads.py"
    script.write_text("import torch\nprint(torch.get_num_threads())\n")
    argv = [PY, "-u", str(script)]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    spawner = Spawner(argv, {}, tmp_path, tmp_path / "t.log")
    try:
        assert spawner.template is not None and spawner.template.wait_ready()
        assert "torch" in spawner.template.preloaded
        proc = spawner.spawn(argv, {**env, "OMP_NUM_THREADS": "1"}, tmp_path / "o", tmp_path / "e")
        assert proc is not None and proc.wait(60) == 0, (tmp_path / "e").read_text()
    finally:
        spawner.close()
    assert (tmp_path / "o").read_text() == "1\n"
