"""`version` from a checkout run in place (an editable install): the commit read from the checkout's
own git files, in real repositories made by git in temporary directories (a branch's loose ref, the
same ref packed, a detached HEAD, a linked worktree), and "unknown" wherever it cannot be told."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from nri_plugin import __version__
from nri_plugin.common import buildinfo
from nri_plugin.common.buildinfo import checkout_commit, version_line

GUARD = 60.0  # against hangs only
PYPROJECT = '[project]\nname = "mixed-cpu-nri-plugin"\nversion = "0.2.0"\n'


def git(cwd: Path, *args: str) -> str:
    if shutil.which("git") is None:
        pytest.fail("git is not installed: these tests make real repositories with it")
    env = {
        **os.environ,
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.invalid",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.invalid",
    }
    result = subprocess.run(
        ["git", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=GUARD, check=True
    )
    return result.stdout.strip()


def commit(repo: Path, text: str) -> str:
    (repo / "notes.txt").write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", text)
    return git(repo, "rev-parse", "HEAD")


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A checkout of "this project": its pyproject.toml, one commit on branch main."""
    repo = tmp_path / "checkout"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "pyproject.toml").write_text(PYPROJECT)
    commit(repo, "first")
    return repo


def test_a_branch_s_loose_ref(checkout: Path) -> None:
    assert (checkout / ".git" / "refs" / "heads" / "main").is_file()
    assert checkout_commit(checkout) == git(checkout, "rev-parse", "HEAD")


def test_a_packed_ref_and_a_newer_loose_one(checkout: Path) -> None:
    first = git(checkout, "rev-parse", "HEAD")
    git(checkout, "pack-refs", "--all", "--prune")
    assert not (checkout / ".git" / "refs" / "heads" / "main").exists()
    assert checkout_commit(checkout) == first
    second = commit(checkout, "second")  # a loose ref again, the packed line now stale
    assert checkout_commit(checkout) == second != first


def test_a_detached_head(checkout: Path) -> None:
    first = git(checkout, "rev-parse", "HEAD")
    commit(checkout, "second")
    git(checkout, "checkout", "-q", "--detach", first)
    assert checkout_commit(checkout) == first


def test_a_linked_worktree_reads_its_own_head_and_the_common_refs(checkout: Path) -> None:
    main_head = git(checkout, "rev-parse", "HEAD")
    linked = checkout.parent / "linked"
    git(checkout, "worktree", "add", "-q", "-b", "topic", str(linked))
    topic_head = commit(linked, "on topic")
    assert (linked / ".git").is_file()  # "gitdir: <main>/.git/worktrees/linked"
    assert checkout_commit(linked) == topic_head != main_head
    assert checkout_commit(checkout) == main_head
    git(checkout, "pack-refs", "--all", "--prune")  # the branch now only in the common packed-refs
    assert checkout_commit(linked) == topic_head


def test_version_line_of_a_checkout_run_in_place(checkout: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(buildinfo, "_ROOT", checkout)
    head = git(checkout, "rev-parse", "HEAD")
    assert version_line() == f"mixed-cpu-nri-plugin {__version__} (commit {head}, checkout)"


def test_unknown_where_it_cannot_be_told(checkout: Path, tmp_path: Path) -> None:
    unborn = tmp_path / "unborn"  # a repository with no commit yet
    unborn.mkdir()
    git(unborn, "init", "-q")
    (unborn / "pyproject.toml").write_text(PYPROJECT)
    assert checkout_commit(unborn) is None

    other = tmp_path / "other"  # another project's checkout (our package copied into it)
    other.mkdir()
    git(other, "init", "-q")
    (other / "pyproject.toml").write_text('[project]\nname = "something-else"\n')
    commit(other, "theirs")
    assert checkout_commit(other) is None

    no_git = tmp_path / "unpacked"  # an unpacked sdist: this project, no git
    no_git.mkdir()
    (no_git / "pyproject.toml").write_text(PYPROJECT)
    assert checkout_commit(no_git) is None

    (checkout / ".git" / "HEAD").write_text("ref: refs/heads/../../../../etc/hostname\n")
    assert checkout_commit(checkout) is None
    (checkout / ".git" / "HEAD").write_text("garbage\n")
    assert checkout_commit(checkout) is None
    (checkout / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (checkout / ".git" / "refs" / "heads" / "main").write_bytes(b"\xff\xfe not a commit\n")
    assert checkout_commit(checkout) is None
