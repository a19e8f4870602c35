"""Secrets stay secret: out of argv (`ps`), the database, `describe`, the logs; in the
workers' environment. The state directory is 0700, its database 0600."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import REPO, SCRIPTS, Trainguard, wait_for
from trainguard.agent.jobenv import JOB_ENV_VAR, encode_job_env, take_job_env
from trainguard.platform import views
from trainguard.platform.store import DB_NAME, Store
from trainguard.spec import SpecError, parse_job, resolve_plan
from trainguard.spec.secrets import (
    REDACTED,
    EnvFileError,
    SecretSource,
    looks_secret,
    read_env_file,
    redact_spec,
    secret_storage_keys,
)

SECRET_WORKER = SCRIPTS / "secret_worker.py"
# Every value here must stay out of argv, the state directory, describe and the logs.
FROM_FILE = "s3cr3t-from-env-file-7f1c"  # HF_TOKEN: valueFrom, in --env-file
FROM_CALLER = "s3cr3t-from-caller-env-22ab"  # FROM_CALLER: valueFrom, in our environment
PLAIN_SECRET = "s3cr3t-plain-wandb-91de"  # WANDB_API_KEY: a plain value, a secret's name
PLAIN_OTHER = "not-s3cr3t-but-off-argv-5c3e"  # DATA_SETTING: plain; only kept off argv
STORAGE_KEY = "AKIAS3CR3TSTORAGEKEY1"  # storageOptions.key
STORAGE_SECRET = "s3cr3t-storage-secret-0e77"  # storageOptions.secret
AWS_SECRET = "s3cr3t-aws-from-caller-44f0"  # AWS_SECRET_ACCESS_KEY, inherited
HIDDEN = (FROM_FILE, FROM_CALLER, PLAIN_SECRET, STORAGE_KEY, STORAGE_SECRET, AWS_SECRET)
OFF_ARGV = (*HIDDEN, PLAIN_OTHER)
CONTAINER = "spec.replicaSpecs[0].template.spec.containers[0]"


def sha(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def job_data(command: list[str], env: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    container = {"name": "trainer", "command": command, "env": env}
    return {
        "apiVersion": "trainguard.dev/v1",
        "kind": "TrainingJob",
        "metadata": {"name": "secrets"},
        "spec": {
            "nprocPerNode": 1,
            "replicaSpecs": [
                {"name": "pods", "replicas": 2, "template": {"spec": {"containers": [container]}}}
            ],
            **spec,
        },
    }


SPEC_ENV: list[dict[str, Any]] = [
    {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "hf-token"}}},
    {"name": "FROM_CALLER", "valueFrom": {"secretKeyRef": {"name": "x", "key": "CALLER_KEY"}}},
    {"name": "WANDB_API_KEY", "value": PLAIN_SECRET},
    {"name": "DATA_SETTING", "value": PLAIN_OTHER},
]
ENV_NAMES = ["HF_TOKEN", "FROM_CALLER", "WANDB_API_KEY", "DATA_SETTING", "AWS_SECRET_ACCESS_KEY"]


def cmdlines() -> dict[int, bytes]:
    """Every process's command line, as any local user reads it."""
    lines: dict[int, bytes] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):  # gone meanwhile
                lines[int(entry.name)] = (entry / "cmdline").read_bytes()
    return lines


def files_under(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def assert_hidden(text: str | bytes, where: str, values: tuple[str, ...] = HIDDEN) -> None:
    data = text.encode() if isinstance(text, str) else text
    for value in values:
        assert value.encode() not in data, f"{value} is in {where}"


def test_a_run_keeps_its_secrets_out_of_ps_the_database_describe_and_logs(
    tg: Trainguard, tmp_path: Path
) -> None:
    out, release = tmp_path / "out", tmp_path / "release"
    out.mkdir()
    command = ["python", str(SECRET_WORKER), "--out", str(out), "--release", str(release)]
    storage = {"key": STORAGE_KEY, "secret": STORAGE_SECRET, "endpoint_url": "http://x:1"}
    spec = job_data(
        [*command, "--names", *ENV_NAMES],
        SPEC_ENV,
        checkpointing={"durableUrl": str(tmp_path / "durable"), "storageOptions": storage},
    )
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    env_file = tmp_path / "secrets.env"
    env_file.write_text(f"# the hf secret\nexport hf-token='{FROM_FILE}'\nOTHER=1\n")
    tg.env.update(CALLER_KEY=FROM_CALLER, AWS_SECRET_ACCESS_KEY=AWS_SECRET)
    proc = tg.popen("run", "-f", str(spec_file), "--env-file", str(env_file))
    try:
        wait_for(lambda: len(list(out.glob("rank-*.json"))) == 2 or proc.poll() is not None)
        assert proc.poll() is None, proc.communicate()
        # While it runs: no process's argv holds a value (ps reads /proc/PID/cmdline).
        lines = cmdlines()
        for pid, line in lines.items():
            assert_hidden(line, f"the command line of pid {pid}", OFF_ARGV)
        ours = [line for line in lines.values() if str(tg.state_dir).encode() in line]
        assert sum(b"trainguard.agent\0--node-id" in line for line in ours) == 2
        workers = [json.loads(p.read_text())["pid"] for p in out.glob("rank-*.json")]
        assert all(pid in lines for pid in workers)  # the agents and workers were looked at
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, check=True).stdout
        assert_hidden(ps, "ps -eo args", OFF_ARGV)
        # ... and the state directory is this user's only.
        state = tg.state_dir
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        for name in (DB_NAME, f"{DB_NAME}-wal", f"{DB_NAME}-shm"):
            if (state / name).exists():
                assert stat.S_IMODE((state / name).stat().st_mode) == 0o600, name
        release.touch()
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        release.touch()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    assert "storageOptions.key, storageOptions.secret: credentials in the spec" in stderr
    # The workers got every value, through their environment.
    for rank in range(2):
        record = json.loads((out / f"rank-{rank}.json").read_text())
        assert record["env"] == {
            "HF_TOKEN": sha(FROM_FILE),
            "FROM_CALLER": sha(FROM_CALLER),
            "WANDB_API_KEY": sha(PLAIN_SECRET),
            "DATA_SETTING": sha(PLAIN_OTHER),
            "AWS_SECRET_ACCESS_KEY": sha(AWS_SECRET),
        }
        assert record["storage"]["key"] == sha(STORAGE_KEY)
        assert record["storage"]["secret"] == sha(STORAGE_SECRET)
        assert not record["job_env_leaked"]
    # Nowhere in the state directory (the database, its WAL, logs, agents' logs) ...
    for path, data in files_under(tg.state_dir).items():
        assert_hidden(data, str(path))
    assert_hidden(stdout + stderr, "the output of trainguard run")
    job = tg.only_job()
    # ... nor in describe, logs (and the stored spec shows *** where a secret was).
    assert_hidden(json.dumps(job), "describe -o json")
    for verb in (("describe", job["id"]), ("logs", job["id"]), ("logs", job["id"], "--rank", "1")):
        done = tg.run(*verb)
        assert done.returncode == 0, done.stderr
        assert_hidden(done.stdout + done.stderr, " ".join(verb))
    container = job["spec"]["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]
    ref = container["env"][0]["valueFrom"]["secretKeyRef"]  # the reference, no value
    assert (ref["name"], ref["key"], container["env"][0].get("value")) == ("hf", "hf-token", None)
    assert container["env"][2]["value"] == REDACTED  # WANDB_API_KEY
    assert container["env"][3]["value"] == PLAIN_OTHER  # DATA_SETTING: not a secret's name
    options = job["spec"]["spec"]["checkpointing"]["storageOptions"]
    assert options == {"key": REDACTED, "secret": REDACTED, "endpoint_url": "http://x:1"}


def run_usage_error(tg: Trainguard, tmp_path: Path, *args: str, **spec: Any) -> str:
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(yaml.safe_dump(job_data(**spec)))
    done = tg.run("run", "-f", str(spec_file), *args, timeout=60)
    assert done.returncode == 2, done.stderr
    assert json.loads(tg.run("list", "-o", "json").stdout) == []  # no job recorded
    return done.stderr


def test_a_missing_key_is_a_usage_error_naming_the_variable(tg: Trainguard, tmp_path: Path) -> None:
    env_file = tmp_path / "x.env"
    env_file.write_text("OTHER=1\n")
    stderr = run_usage_error(
        tg, tmp_path, "--env-file", str(env_file), command=["python", "t.py"], env=SPEC_ENV[:1]
    )
    assert stderr == (
        f"trainguard: {tmp_path / 'job.yaml'}: {CONTAINER}.env[0].valueFrom.secretKeyRef.key: "
        f"HF_TOKEN: 'hf-token' is in none of: --env-file {env_file}, the environment of "
        "trainguard run\n"
    )


def test_an_unreadable_env_file_is_a_usage_error_quoting_no_line(
    tg: Trainguard, tmp_path: Path
) -> None:
    missing = tmp_path / "missing.env"
    stderr = run_usage_error(tg, tmp_path, "--env-file", str(missing), command=["true"], env=[])
    assert stderr == f"trainguard: --env-file {missing}: file not found\n"
    bad = tmp_path / "bad.env"
    bad.write_text(f"A=1\n{FROM_FILE}\n")
    stderr = run_usage_error(tg, tmp_path, "--env-file", str(bad), command=["true"], env=[])
    assert stderr == f"trainguard: --env-file {bad}: line 2: expected KEY=VALUE\n"


def test_a_secret_expanded_into_the_command_is_refused(tg: Trainguard, tmp_path: Path) -> None:
    tg.env["hf-token"] = FROM_FILE
    stderr = run_usage_error(
        tg, tmp_path, command=["python", "t.py", "--token=$(HF_TOKEN)"], env=SPEC_ENV[:1]
    )
    assert f"{CONTAINER}.command[2]: $(HF_TOKEN) would put a secret on the workers'" in stderr
    assert_hidden(stderr, "the error")


# -- the rules, without processes ----------------------------------------------------------


def plan_env(env: list[dict[str, Any]], source: SecretSource, **container: Any) -> dict[str, str]:
    job = parse_job(job_data(["python", "t.py"], env, **container), "job.yaml")
    return resolve_plan(job, "job.yaml", source).groups[0].env


def test_secret_key_refs_resolve_from_the_last_env_file_then_the_environment(
    tmp_path: Path,
) -> None:
    first, second = tmp_path / "a.env", tmp_path / "b.env"
    first.write_text('hf-token="from a"\nCALLER_KEY=from a\n')
    second.write_text("hf-token=from b\n")
    source = SecretSource.load([str(first), str(second)], {"CALLER_KEY": "env", "hf-token": "e"})
    env = plan_env(SPEC_ENV[:2], source)
    assert env == {"HF_TOKEN": "from b", "FROM_CALLER": "from a"}
    env = plan_env(SPEC_ENV[:2], SecretSource.load([], {"CALLER_KEY": "c", "hf-token": "h"}))
    assert env == {"HF_TOKEN": "h", "FROM_CALLER": "c"}
    plan = resolve_plan(
        parse_job(job_data(["python", "t.py"], SPEC_ENV[:1]), "job.yaml"),
        "job.yaml",
        SecretSource((), {"hf-token": FROM_FILE}),
    )
    assert FROM_FILE not in repr(plan)  # a plan in a traceback or a log shows no secret


def test_only_secret_key_refs_are_resolved_locally() -> None:
    env = [{"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    with pytest.raises(SpecError) as err:
        plan_env(env, SecretSource())
    assert str(err.value) == (
        f"job.yaml: {CONTAINER}.env[0].valueFrom: not supported by the local platform "
        "(only secretKeyRef)"
    )


def test_a_value_made_of_a_secret_is_a_secret_too() -> None:
    env = [*SPEC_ENV[:1], {"name": "HEADER", "value": "Bearer $(HF_TOKEN)"}]
    job = parse_job(job_data(["python", "t.py", "$(HEADER)"], env), "job.yaml")
    with pytest.raises(SpecError, match=r"command\[2\]: \$\(HEADER\) would put a secret"):
        resolve_plan(job, "job.yaml", SecretSource((), {"hf-token": "x"}))
    job = parse_job(job_data(["python", "t.py", "$(WANDB_API_KEY)"], SPEC_ENV[2:]), "job.yaml")
    with pytest.raises(SpecError, match=r"\$\(WANDB_API_KEY\) would put a secret"):
        resolve_plan(job, "job.yaml")
    job = parse_job(job_data(["python", "t.py", "$(DATA_SETTING)"], SPEC_ENV[3:]), "job.yaml")
    assert resolve_plan(job, "job.yaml").groups[0].command[-1] == PLAIN_OTHER  # not a secret


def test_env_file_lines(tmp_path: Path) -> None:
    path = tmp_path / "x.env"
    path.write_text("# comment\n\nexport A=1\nB='two words'\nC=\"x=y\"\nD=\nE='unmatched\n")
    assert read_env_file(path) == {
        "A": "1",
        "B": "two words",
        "C": "x=y",
        "D": "",
        "E": "'unmatched",
    }
    path.write_text("A=1\nnot a line\n")
    with pytest.raises(EnvFileError, match=r"line 2: expected KEY=VALUE$"):
        read_env_file(path)


def test_secret_names() -> None:
    for name in ("HF_TOKEN", "WANDB_API_KEY", "DB_PASSWORD", "GOOGLE_APPLICATION_CREDENTIALS"):
        assert looks_secret(name)
    for name in ("DATA_DIR", "NCCL_DEBUG", "OMP_NUM_THREADS", "endpoint_url", "region_name"):
        assert not looks_secret(name)


def test_redaction_of_a_spec() -> None:
    data = job_data(
        ["python", "t.py", "--url", "https://me:pw@host/x"],
        SPEC_ENV,
        checkpointing={
            "durableUrl": "s3://bucket/x",
            "storageOptions": {
                "key": "k",
                "anon": False,
                "client_kwargs": {"region_name": "eu", "aws_session_token": "t"},
                "profile": "train",
            },
        },
    )
    shown = redact_spec(data)
    container = shown["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]
    assert container["command"][-1] == f"https://me:{REDACTED}@host/x"
    assert [var.get("value") for var in container["env"]] == [None, None, REDACTED, PLAIN_OTHER]
    assert shown["spec"]["checkpointing"]["storageOptions"] == {
        "key": REDACTED,
        "anon": False,
        "client_kwargs": {"region_name": "eu", "aws_session_token": REDACTED},
        "profile": "train",
    }
    assert data["spec"]["checkpointing"]["storageOptions"]["key"] == "k"  # a copy
    options = data["spec"]["checkpointing"]["storageOptions"]
    assert secret_storage_keys(options) == ["key", "client_kwargs.aws_session_token"]


def test_describe_redacts_a_spec_stored_before_redaction(tmp_path: Path, capsys: Any) -> None:
    store = Store(tmp_path / "state")
    data = job_data(["python", "t.py"], SPEC_ENV[2:])
    store.create_job("j-1", "secrets", "job.yaml", tmp_path / "j-1", 2, 1, data)
    assert views.describe(store, "j-1", "json") == 0
    assert_hidden(capsys.readouterr().out, "describe -o json")
    store.close()


def test_the_state_dir_and_database_are_private(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh"
    Store(fresh).close()
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    assert stat.S_IMODE((fresh / DB_NAME).stat().st_mode) == 0o600
    # An older trainguard's: 0755 and 0644; opening it fixes both.
    old = tmp_path / "old"
    Store(old).close()
    old.chmod(0o755)
    (old / DB_NAME).chmod(0o644)
    Store(old).close()
    assert stat.S_IMODE(old.stat().st_mode) == 0o700
    assert stat.S_IMODE((old / DB_NAME).stat().st_mode) == 0o600


def test_the_agent_takes_the_job_env_from_its_environment() -> None:
    environ = {"PATH": "/bin", **encode_job_env({"A": "1", "HF_TOKEN": FROM_FILE})}
    assert take_job_env(environ) == {"A": "1", "HF_TOKEN": FROM_FILE}
    assert environ == {"PATH": "/bin"}  # taken out: the workers do not inherit the blob
    assert take_job_env({}) == {}
    for bad in ("[1]", '{"A": 1}', "{"):
        with pytest.raises(ValueError, match=JOB_ENV_VAR):
            take_job_env({JOB_ENV_VAR: bad})


def test_a_bad_agent_env_flag_quotes_no_value(tmp_path: Path) -> None:
    agent = [sys.executable, "-m", "trainguard.agent", "--node-id", "n", "--token-env", "T"]
    done = subprocess.run(
        [*agent, "--log-dir", str(tmp_path), "--env", f"={FROM_FILE}", "--", "true"],
        capture_output=True,
        text=True,
        env={**os.environ, "T": "x"},
        cwd=REPO,
        timeout=60,
    )
    assert done.returncode == 2
    assert "expected KEY=VALUE" in done.stderr
    assert_hidden(done.stderr, "the agent's error")
