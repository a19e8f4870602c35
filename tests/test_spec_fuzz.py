"""Fuzzing spec loading (hypothesis): whatever the document, only a clean SpecError comes
out of load_job / parse_job / resolve_plan, never another exception (a traceback).

The documents are the example specs (examples/, docs/examples/, tests/data) mutated: a
value replaced by one of a random type, a key dropped or added, characters of the YAML
text replaced by YAML's own punctuation (anchors, aliases, tags, flow collections). A
job that is valid must also store (json.dumps of its dump) and resolve into a plan.
"""

from __future__ import annotations

import contextlib
import copy
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainguard.spec import SpecError, TrainingJob, load_job, parse_job, resolve_plan
from trainguard.spec import plan as plan_module

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(
    [
        *(REPO / "examples").glob("*/*.yaml"),
        *(REPO / "docs" / "examples").glob("*.yaml"),
        *(REPO / "tests" / "data").glob("*.yaml"),
    ]
)
TEXTS = [path.read_text(encoding="utf-8") for path in EXAMPLES]
DOCUMENTS = [yaml.safe_load(text) for text in TEXTS]
FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,  # the same examples every run: a failure is reproducible
    database=None,
)


@pytest.fixture(autouse=True)
def no_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """nprocPerNode auto/gpu would import torch (seconds): no CUDA device here."""
    monkeypatch.setattr(plan_module, "_cuda_device_count", lambda: 0)


def check(load: Any) -> None:
    """Run `load` (-> TrainingJob): a SpecError is fine; a job must store and plan."""
    try:
        job: TrainingJob = load()
    except SpecError as err:
        assert str(err)  # one line per problem, never empty
        return
    json.dumps(job.model_dump(mode="json", by_alias=True))  # as the store writes it
    with contextlib.suppress(SpecError):
        resolve_plan(job, "fuzz")


# --- values -------------------------------------------------------------------------------

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["auto", "gpu", "cpu", "0", "-1", "1e308", ".inf", "", "$(X)", "(a+)+$"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)


def paths(node: object, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path into a document (mapping keys and list indexes)."""
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from paths(value, (*prefix, index))


@st.composite
def mutated(draw: st.DrawFn) -> object:
    """An example document with 1-3 random changes."""
    data: Any = copy.deepcopy(draw(st.sampled_from(DOCUMENTS)))
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(list(paths(data))))
        if not where:
            data = draw(VALUES) if draw(st.integers(0, 9)) == 0 else data
            continue
        parent: Any = data
        for part in where[:-1]:
            parent = parent[part]
        action = draw(st.sampled_from(["replace", "replace", "drop", "add"]))
        if action == "replace":
            parent[where[-1]] = draw(VALUES)
        elif action == "drop":
            del parent[where[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=12))] = draw(VALUES)
        else:
            parent.append(draw(VALUES))
    return data


@given(data=mutated())
@FUZZ
def test_parse_job_of_mutated_examples_raises_only_spec_error(data: object) -> None:
    check(lambda: parse_job(data, "fuzz.yaml"))


@given(data=VALUES)
@FUZZ
def test_parse_job_of_random_data_raises_only_spec_error(data: object) -> None:
    check(lambda: parse_job(data, "fuzz.yaml"))


# --- YAML text ----------------------------------------------------------------------------

YAML_BITS = st.sampled_from(
    [
        "&a ", "*a", "*b", "&b ", "!!set ", "!!binary ", "!!timestamp ", "!!omap ", "!!float ",
        "!!python/object:os.system ", "!!int ", "<<: *a\n", "[", "]", "{", "}", ",", ": ",
        "- ", "\n", "  ", "'", '"', "#", "|", ">", "%YAML 1.1\n", "---\n", "...\n", "? ", "\t",
        "\\",
        ".inf", ".nan", "1e308", "0x7f", "0o17", "1_000", "2001-12-14", "~", "\x00", "\ufeff",
        "9" * 50,
    ]
)  # fmt: skip


@st.composite
def mutated_text(draw: st.DrawFn) -> str:
    """An example's YAML text with 1-4 spans replaced by YAML punctuation or junk."""
    text = draw(st.sampled_from(TEXTS))
    for _ in range(draw(st.integers(1, 4))):
        start = draw(st.integers(0, len(text)))
        end = min(len(text), start + draw(st.integers(0, 8)))
        bit = draw(st.one_of(YAML_BITS, st.text(max_size=6)))
        text = text[:start] + bit + text[end:]
    return text


@pytest.fixture(scope="module")
def spec_file() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp) / "fuzz.yaml"


@given(text=mutated_text())
@FUZZ
def test_load_job_of_mutated_yaml_raises_only_spec_error(spec_file: Path, text: str) -> None:
    spec_file.write_bytes(text.encode("utf-8", "surrogatepass"))
    check(lambda: load_job(spec_file))
