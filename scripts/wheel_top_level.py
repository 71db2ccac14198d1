#!/usr/bin/env python3
"""Print the top-level import names a wheel installs, one a line, sorted: the first path component
of every file outside its .dist-info and .data directories (a module file's name without .py).

Usage: python3 scripts/wheel_top_level.py WHEEL
"""

from __future__ import annotations

import sys
import zipfile


def top_level(wheel: str) -> list[str]:
    names = set()
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            first = name.split("/", 1)[0]
            if first.endswith((".dist-info", ".data")):
                continue
            names.add(first.removesuffix(".py") if "/" not in name else first)
    return sorted(names)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print("\n".join(top_level(sys.argv[1])))
