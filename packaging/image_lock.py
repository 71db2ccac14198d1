"""The image's lock file (packaging/image.lock), from the wheels packaging/build-image.sh downloaded.

python3 packaging/image_lock.py pins DIR           name==version of each wheel in DIR
python3 packaging/image_lock.py write LOCK DIR...  the lock: each pin with its wheels' sha256s
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections.abc import Iterator
from pathlib import Path


def wheels(folder: str) -> Iterator[tuple[str, str, str]]:
    """(normalized name, version, sha256) of each wheel in folder."""
    for wheel in sorted(Path(folder).glob("*.whl")):
        name, version = wheel.name.split("-")[:2]
        yield re.sub(r"[-_.]+", "-", name).lower(), version, hashlib.sha256(wheel.read_bytes()).hexdigest()


def lock_text(folders: list[str]) -> str:
    pins: dict[tuple[str, str], set[str]] = {}
    for folder in folders:
        for name, version, digest in wheels(folder):
            pins.setdefault((name, version), set()).add(digest)
    lines = [
        "# The image's Python dependencies: what `pip install mixed-cpu-nri-plugin[dra]` needs on the",
        "# image's Python, pinned, with the sha256 of each wheel for "
        + ", ".join(Path(folder).name for folder in folders)
        + ".",
        "# Made by `packaging/build-image.sh lock` (it resolves on PyPI); the image installs exactly these.",
    ]
    for (name, version), digests in sorted(pins.items()):
        entry = [f"{name}=={version}", *(f"    --hash=sha256:{digest}" for digest in sorted(digests))]
        lines.extend(line + " \\" for line in entry[:-1])
        lines.append(entry[-1])
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "pins":
        print(" ".join(f"{name}=={version}" for name, version, _ in wheels(argv[1])))
        return 0
    if len(argv) >= 3 and argv[0] == "write":
        Path(argv[1]).write_text(lock_text(argv[2:]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
