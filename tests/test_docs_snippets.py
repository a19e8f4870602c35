"""Every code block of the docs (README.md and docs/**/*.md) is run or checked.

- ``python``: run. A block that needs the script around it (a model, ``train_step``)
  names a harness in a marker (``<!-- snippet: harness NAME -->``, see
  ``tests/docs_blocks.py``): ``tests/docs_harness/NAME.py`` gives it those names. A block
  that needs torch.distributed is marked ``job`` and runs on both ranks of a real
  ``trainguard run`` job (e2e); the blocks of one kind of job share one run.
- ``yaml``: a TrainingJob (it has ``apiVersion``) is loaded by trainguard's spec loader
  (``load_job``). A fragment whose keys are fields of one spec object (``spec:``,
  ``trainguard:``, a container's ``env:``) is put at that object's place in the starting
  spec, ``docs/examples/job-minimal.yaml`` (a ``...`` value keeps the starting spec's),
  and loaded the same way. Any other YAML must parse.
- ``sh``, ``bash``, ``console``: bash's syntax check, then each command line as
  ``tests/docs_shell.py`` says: ``trainguard`` lines parsed by trainguard's own parser
  (never run), make targets, repository paths.
- ``text``, ``dockerfile``: output samples and a Dockerfile; not code to run here.
- ``diff``: a unified diff between two files of the repository (its ``---``/``+++``
  lines name them): it must be what ``difflib`` makes of them now.
- ``<!-- snippet: skip REASON -->``: not run; ``test_skipped_block`` reports each as a
  skip with its reason (``pytest -rs`` lists them).
"""

from __future__ import annotations

import copy
import difflib
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from conftest import Trainguard
from docs_blocks import (
    DIFF,
    MARKER_KINDS,
    NOT_CODE,
    PYTHON,
    REPO,
    SHELL,
    UNLABELLED_ALLOWED,
    YAML,
    Block,
    blocks,
    of_language,
    skipped,
)
from docs_shell import command_lines, problems, simple_commands, variants
from trainguard.spec import load_job
from trainguard.spec.kube import Container
from trainguard.spec.model import TrainguardOptions, TrainingJob, TrainingJobSpec

HARNESS = REPO / "tests" / "docs_harness"
STARTING_SPEC = REPO / "docs" / "examples" / "job-minimal.yaml"
# Where a fragment of each spec object goes in the starting spec.
FRAGMENT_PLACES: list[tuple[type[BaseModel], list[str | int]]] = [
    (TrainingJob, []),
    (TrainingJobSpec, ["spec"]),
    (TrainguardOptions, ["spec", "trainguard"]),
    (Container, ["spec", "replicaSpecs", 0, "template", "spec", "containers", 0]),
]
# The jobs the `job` blocks run in, by harness: the blocks of one job share its run (its
# processes, in the order of the pages). Each job is 1 node x 2 processes. A whole script
# sets its process group up and destroys it, and a `@restartable` function under
# `inProcessRestart` owns its process groups, so each has a job of its own. The elastic
# page's `@restartable` block runs in the plain job, on the group the checkpoint blocks'
# harness made: its calls (`run.batch_split`, `run.shard`) are what it shows; scaling in
# place is tests/test_run_elastic_inplace.py's.
JOB_OF_HARNESS = {
    "checkpoint_loop": "plain",
    "resilient_elastic": "plain",
    "standalone": "script",
    "resilient_train": "in-process",
}
# controllerGraceSeconds 0: a job this test gives up on (its timeout) leaves no agents.
JOB_SPEC: dict[str, dict[str, Any]] = {
    "plain": {"trainguard": {"controllerGraceSeconds": 0}},
    "script": {"trainguard": {"controllerGraceSeconds": 0}},
    "in-process": {"trainguard": {"controllerGraceSeconds": 0, "inProcessRestart": True}},
}


def _ids(found: list[Block]) -> list[str]:
    return [block.id for block in found]


def test_every_block_is_in_a_known_language() -> None:
    known = (*PYTHON, *YAML, *SHELL, *NOT_CODE, *DIFF)
    unknown = [
        f"{b.id}: ```{b.language}"
        for b in blocks()
        if b.language not in known and not (b.language == "" and b.page in UNLABELLED_ALLOWED)
    ]
    assert not unknown, "label each block python, yaml, sh, console or text:\n" + "\n".join(unknown)
    markers = [f"{b.id}: {b.marker}" for b in blocks() if b.marker and b.marker not in MARKER_KINDS]
    assert not markers, markers


def test_every_python_block_has_a_way_to_run() -> None:
    for block in of_language(PYTHON):
        if block.marker in ("harness", "job"):
            assert (HARNESS / f"{block.marker_arg}.py").is_file(), block.id
        if block.marker == "job":
            assert block.marker_arg in JOB_OF_HARNESS, f"{block.id}: no job for its harness"


@pytest.mark.parametrize(
    "block",
    [b for b in of_language(PYTHON) if b.marker != "job"],
    ids=_ids([b for b in of_language(PYTHON) if b.marker != "job"]),
)
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    file = _write_block(block, tmp_path, 0)
    argv = [sys.executable, str(HARNESS / "run.py"), f"{block.marker_arg or 'standalone'}={file}"]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"docs block ok: {file.name}" in done.stdout


def _job_blocks() -> dict[str, list[Block]]:
    jobs: dict[str, list[Block]] = defaultdict(list)
    for block in of_language(PYTHON):
        if block.marker == "job":
            jobs[JOB_OF_HARNESS.get(block.marker_arg, "?")].append(block)
    return dict(jobs)


@pytest.mark.e2e
@pytest.mark.parametrize("job", sorted(_job_blocks()))
def test_python_blocks_run_in_a_job(job: str, tmp_path: Path) -> None:
    found = _job_blocks()[job]
    files = [_write_block(block, tmp_path, n) for n, block in enumerate(found)]
    pairs = [f"{block.marker_arg}={file}" for block, file in zip(found, files, strict=True)]
    command = ["python", str(HARNESS / "run.py"), *pairs]
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(yaml.safe_dump(_job_spec(f"docs-{job}", command, JOB_SPEC[job])))
    tg = Trainguard(tmp_path / "state")
    done = subprocess.run(
        tg.argv("run", "-f", str(spec_file), "--no-live"),
        env=tg.env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for rank in (0, 1):
        for file in files:
            assert f"[rank{rank}]: docs block ok: {file.name}" in done.stdout, output


def _job_spec(name: str, command: list[str], extra: dict[str, Any]) -> dict[str, Any]:
    container = {"name": "trainer", "command": command}
    group = {"name": "worker", "replicas": 1, "template": {"spec": {"containers": [container]}}}
    spec = {"nprocPerNode": 2, "replicaSpecs": [group], **extra}
    return {
        "apiVersion": "trainguard.dev/v1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": spec,
    }


def _write_block(block: Block, directory: Path, index: int) -> Path:
    page = block.page.replace("/", "-").removesuffix(".md")
    file = directory / f"block-{index}-{page}-{block.line}.py"
    file.write_text(block.padded(), encoding="utf-8")
    return file


@pytest.mark.parametrize("block", of_language(YAML), ids=_ids(of_language(YAML)))
def test_yaml_block_loads(block: Block, tmp_path: Path) -> None:
    text = (Path(block.page).parent / block.include).as_posix() if block.include else ""
    source = (REPO / text).read_text(encoding="utf-8") if text else block.code
    data = yaml.safe_load(source)
    place = _place_of(data)
    if place is None:
        return  # YAML, but no spec object: parsing it is the check
    if "apiVersion" not in data:  # a fragment: into the starting spec
        base = yaml.safe_load(STARTING_SPEC.read_text(encoding="utf-8"))
        data = _merged(base, _nest(place, data))
        source = yaml.safe_dump(data)
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(source, encoding="utf-8")
    load_job(spec_file)  # a SpecError names the field


def _place_of(data: object) -> list[str | int] | None:
    if not isinstance(data, dict) or not data:
        return None
    for model, place in FRAGMENT_PLACES:
        fields = {field.alias or name for name, field in model.model_fields.items()}
        if set(data) <= fields:
            return place
    return None


def _nest(place: list[str | int], data: object) -> Any:
    for key in reversed(place):
        data = {key: data} if isinstance(key, str) else [data]
    return data


def _merged(base: Any, fragment: Any) -> Any:
    """``fragment`` over ``base``: mappings key by key, lists item by item; ``...`` keeps."""
    if fragment == "...":
        return copy.deepcopy(base)
    if isinstance(base, dict) and isinstance(fragment, dict):
        merged = copy.deepcopy(base)
        for key, value in fragment.items():
            merged[key] = _merged(base.get(key), value)
        return merged
    if isinstance(base, list) and isinstance(fragment, list):
        return [
            _merged(base[i] if i < len(base) else None, item) for i, item in enumerate(fragment)
        ]
    return copy.deepcopy(fragment)


@pytest.mark.parametrize("block", of_language(SHELL), ids=_ids(of_language(SHELL)))
def test_shell_block_is_accepted(block: Block) -> None:
    lines = command_lines(block.code, console=block.language == "console")
    assert lines, f"{block.id}: no command in it"
    syntax = subprocess.run(
        ["bash", "-n"], input="\n".join(lines), capture_output=True, text=True, timeout=30
    )
    assert syntax.returncode == 0, syntax.stderr
    found = []
    for line in lines:
        for variant in variants(line):
            for words in simple_commands(variant):
                found += problems(words)
    assert not found, f"{block.id}:\n" + "\n".join(found)


@pytest.mark.parametrize("block", of_language(DIFF), ids=_ids(of_language(DIFF)))
def test_diff_block_is_the_diff_of_its_files(block: Block) -> None:
    lines = block.code.rstrip("\n").splitlines()
    assert len(lines) > 2 and lines[0].startswith("--- ") and lines[1].startswith("+++ "), block.id
    old, new = lines[0].removeprefix("--- "), lines[1].removeprefix("+++ ")
    a = (REPO / old).read_text(encoding="utf-8").splitlines()
    b = (REPO / new).read_text(encoding="utf-8").splitlines()
    made = [  # with as many lines of context as the block shows; blank lines as blank
        [line.rstrip() for line in difflib.unified_diff(a, b, old, new, lineterm="", n=n)]
        for n in range(len(a) + len(b) + 1)
    ]
    assert [line.rstrip() for line in lines] in made, f"{block.id}: not the diff of {old}, {new}"


@pytest.mark.parametrize("block", skipped(), ids=_ids(skipped()))
def test_skipped_block(block: Block) -> None:
    assert block.marker_arg, f"{block.id}: a skip marker says why"
    pytest.skip(f"{block.id} ({block.language}): {block.marker_arg}")
