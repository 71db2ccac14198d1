"""Every file of the project a source comment or docstring cites exists in the repository: a comment
that sends a reader to ``docs/status.md`` or ``tests/node_story.py`` must not send them nowhere (five
once cited a notes file that was never in the repository).

A citation is a Markdown file (``design.md``, ``docs/status.md``: by its path from the repository's
root, or by its bare name when some file of the repository has that name), or a path under one of the
repository's top-level directories (``tests/data/...``, ``packaging/helm/...``). Comments and
docstrings are read with the tokenizer and the parser, so paths inside code (test data, host paths)
are not taken for citations.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest
from mixedcpu_support import ROOT

TOP = (
    "docs",
    "tests",
    "scripts",
    "packaging",
    "bench",
    "fuzz",
    "examples",
    "api",
    "cgroups",
    "nri_plugin",
    ".ci",
)
MARKDOWN = re.compile(r"(?<![\w/.-])([\w.-][\w./-]*\.md)\b")
REPO_PATH = re.compile(rf"(?<![\w/.-])((?:{'|'.join(re.escape(t) for t in TOP)})/[\w./-]*[\w/])")
# Documents of other projects a comment may name by their own file name.
UPSTREAM = {
    "SPEC.md": "the Container Device Interface's specification (cncf-tags/container-device-interface)"
}


def tracked_files() -> list[str]:
    try:
        listed = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the repository's files cannot be listed")
    return listed.stdout.split()


def comments_and_docstrings(source: str) -> list[str]:
    texts = [
        token.string
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node, clean=False)
            if docstring:
                texts.append(docstring)
    return texts


def citations(text: str) -> list[str]:
    found = [match.removeprefix("./") for match in MARKDOWN.findall(text)]
    found += [match.rstrip("/.") for match in REPO_PATH.findall(text)]
    return list(dict.fromkeys(found))


def test_the_finder_finds_citations_and_nothing_else() -> None:
    text = 'see docs/status.md, "x"; design.md; tests/data/cdi/ and packaging/helm/a.yaml. /etc/x/docs/y.md'
    assert citations(text) == ["docs/status.md", "design.md", "tests/data/cdi", "packaging/helm/a.yaml"]
    assert comments_and_docstrings('"""a.md"""\nx = "b.md"  # c.md\n') == ["# c.md", "a.md"]


def test_every_file_a_source_comment_cites_exists() -> None:
    files = tracked_files()
    tracked = set(files)
    names = {Path(f).name for f in files}
    directories = {str(parent) for f in files for parent in Path(f).parents}
    missing = []
    for name in files:
        if not name.endswith(".py"):
            continue
        for text in comments_and_docstrings((ROOT / name).read_text(encoding="utf-8")):
            for cited in citations(text):
                if "/" in cited:
                    found = cited in tracked or cited in directories
                else:
                    found = cited in names or cited in UPSTREAM
                if not found:
                    missing.append(f"{name}: {cited}")
    assert not missing, "cited and not in the repository (git add a new file):\n" + "\n".join(
        sorted(set(missing))
    )
