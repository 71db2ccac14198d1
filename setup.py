"""The build's one addition to pyproject.toml: record the commit a wheel or sdist is built from.

The module ``nri_plugin._build_info`` (read by `nri_plugin.common.buildinfo`) is written into what is built,
never into the source tree: into the sdist's tree, and into the wheel's build directory (not for
an editable install: the checkout it runs moves on, so `nri_plugin.common.buildinfo` reads the
checkout's commit from its git files when asked). The commit
is ``MIXED_CPU_NRI_BUILD_COMMIT`` when set, else ``git rev-parse HEAD`` of the checkout (``+dirty``
when tracked files differ from it); a build from an sdist (no git) keeps the module the sdist
carries; with neither, "unknown".
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
MODULE = Path("nri_plugin") / "_build_info.py"


def _git(*args: str) -> str | None:
    if not (HERE / ".git").exists():
        return None
    try:
        result = subprocess.run(
            ["git", "-C", str(HERE), *args], capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip()


def current_commit() -> str | None:
    """The commit being built, or None when nothing says."""
    given = os.environ.get("MIXED_CPU_NRI_BUILD_COMMIT", "").strip()
    if given:
        return given
    head = _git("rev-parse", "HEAD")
    if not head:
        return None
    changed = _git("status", "--porcelain", "--untracked-files=no")
    return f"{head}+dirty" if changed else head


def write_build_info(root: Path, commit: str) -> None:
    path = root / MODULE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        '"""Written by the build (setup.py): the commit this copy was built from."""\n\n'
        f"COMMIT = {commit!r}\n"
    )


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # a checkout run in place moves on: a commit written now would soon be wrong
        commit = current_commit()
        if commit is not None:
            write_build_info(Path(self.build_lib), commit)
        elif (HERE / MODULE).exists():  # an sdist's, copied by build_py with the package
            pass
        else:
            write_build_info(Path(self.build_lib), "unknown")


class Sdist(sdist):
    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        write_build_info(Path(base_dir), current_commit() or "unknown")


setup(cmdclass={"build_py": BuildPy, "sdist": Sdist})
