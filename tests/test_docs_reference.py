"""The docs' generated pages are current, and the README's links lead somewhere.

The reference pages (docs/reference/spec.md, cli.md) are written by
docs/generate_reference.py from the spec's JSON Schema and the CLI's parser; a field or
flag changed without `make docs` fails here. The docs site's own links are checked by
`make docs` (Sphinx, warnings as errors); the README is not part of the site, so its
links to pages and their headings are checked here.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "generate_reference", REPO / "docs" / "generate_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page", ["spec.md", "cli.md"])
def test_generated_reference_page_is_current(page: str) -> None:
    path = REPO / "docs" / "reference" / page
    expected = _generator().pages()[path]
    assert path.read_text(encoding="utf-8") == expected, (
        f"{path.relative_to(REPO)} is stale: run `make docs` (or "
        "`.venv/bin/python docs/generate_reference.py`) and commit it"
    )


def test_readme_links_lead_to_files_and_headings() -> None:
    readme = REPO / "README.md"
    broken = []
    for target in _LINK.findall(readme.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = target.partition("#")
        path = (readme.parent / file) if file else readme
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and anchor not in _slugs(path):
            broken.append(f"{target}: no heading with that anchor in {file or 'README.md'}")
    assert not broken, broken


def _slugs(page: Path) -> set[str]:
    """The anchors GitHub (and the docs site, myst_heading_anchors) give a page's headings."""
    slugs = set()
    in_fence = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        elif not in_fence and (heading := re.match(r"^#{1,6}\s+(.*)$", line)):
            text = heading[1].replace("`", "").strip().lower()
            slugs.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text)))
    return slugs


def test_slugs_are_githubs() -> None:
    page = REPO / "docs" / "elastic.md"
    assert "in-place-resilientrestartable-scripts" in _slugs(page)
    assert "in-the-script-trainguardelastic" in _slugs(page)
