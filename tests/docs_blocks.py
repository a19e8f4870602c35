"""The code blocks of the docs (README.md and docs/**/*.md), read for the docs tests.

A block is a fenced code block; its language (the fence's info string) says how the tests
treat it (see ``tests/test_docs_snippets.py``). A marker, an HTML comment right before the
block, changes that, and shows on the page's source:

- ``<!-- snippet: skip REASON -->``: not run; the tests list it as skipped with REASON;
- ``<!-- snippet: harness NAME -->``: a Python block run with the names that
  ``tests/docs_harness/NAME.py`` gives it (a model, ``train_step``...);
- ``<!-- snippet: job NAME -->``: the same, as the workers of a real ``trainguard run``.

MyST directives (```` ```{toctree} ````) are not code; ``{literalinclude}`` is, as the
file it includes.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from markdown_it import MarkdownIt

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"

# How each language is treated; a block in any other language fails the tests.
PYTHON = ("python",)
YAML = ("yaml",)
SHELL = ("sh", "bash", "console")
NOT_CODE = ("text", "dockerfile")  # output samples; a Dockerfile (see its marker)
DIFF = ("diff",)  # the unified diff of two files of the repository, named in its header
# Pages whose blocks may have no language: docs/architecture.md is kept as it is (its
# diagram is a block without one).
UNLABELLED_ALLOWED = ("docs/architecture.md",)

_MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(?P<kind>[\w-]+)\s*(?P<arg>.*?)\s*-->\s*$", re.S)
MARKER_KINDS = ("skip", "harness", "job")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository, e.g. docs/faults.md
    line: int  # of the opening fence, 1-based
    language: str
    code: str  # dedented
    marker: str = ""  # skip, harness or job
    marker_arg: str = ""  # the reason, or the harness's name
    include: str = ""  # a literalinclude's file, relative to the page

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def first_code_line(self) -> int:
        return self.line + 1

    def padded(self) -> str:
        """The code, with a first comment naming the page and blank lines up to its line."""
        return f"# docs block: {self.page}\n" + "\n" * (self.first_code_line - 2) + self.code


def pages() -> list[Path]:
    """README.md and every Markdown page of the docs site."""
    found = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)
    return [REPO / "README.md", *found]


@cache
def blocks() -> tuple[Block, ...]:
    parser = MarkdownIt("commonmark")
    found: list[Block] = []
    for path in pages():
        page = path.relative_to(REPO).as_posix()
        tokens = parser.parse(path.read_text(encoding="utf-8"))
        for index, token in enumerate(tokens):
            if token.type != "fence" or token.map is None:
                continue
            info = token.info.strip()
            include = ""
            if info.startswith("{"):
                directive, _, argument = info.partition(" ")
                if directive != "{literalinclude}":
                    continue  # a MyST directive (toctree, note...), not code
                include = argument.strip()
                options = dict(re.findall(r"^:(\w+):\s*(.*)$", token.content, re.M))
                info = options.get("language", "")
            kind, arg = _marker(tokens[index - 1] if index else None)
            found.append(
                Block(
                    page=page,
                    line=token.map[0] + 1,
                    language=info.split()[0] if info else "",
                    code=textwrap.dedent(token.content),
                    marker=kind,
                    marker_arg=arg,
                    include=include,
                )
            )
    return tuple(found)


def _marker(token: object) -> tuple[str, str]:
    if getattr(token, "type", None) != "html_block":
        return "", ""
    match = _MARKER.match(getattr(token, "content", ""))
    if match is None:
        return "", ""
    return match["kind"], " ".join(match["arg"].split())


def of_language(languages: tuple[str, ...]) -> list[Block]:
    """The blocks in these languages that no skip marker takes out."""
    return [b for b in blocks() if b.language in languages and b.marker != "skip"]


def skipped() -> list[Block]:
    return [b for b in blocks() if b.marker == "skip"]
