#!/usr/bin/env python3
"""Regenerate the committed Python modules of every .proto file under api/.

Usage: python scripts/gen_proto.py [--out DIR]

With --out, the generated files are written below DIR instead of the source
tree (the test suite uses this to check that the committed files are current).
Needs grpcio-tools and mypy-protobuf (the 'test' extra).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def proto_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "api").rglob("*.proto"))


def generate(out: Path) -> None:
    import grpc_tools

    bundled = Path(grpc_tools.__file__).parent / "_proto"
    plugin = Path(sys.executable).parent / "protoc-gen-mypy"
    out.mkdir(parents=True, exist_ok=True)
    args = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        "-I",
        str(ROOT),
        "-I",
        str(bundled),
        f"--python_out={out}",
        f"--mypy_out={out}",
        f"--plugin=protoc-gen-mypy={plugin}",
        *proto_files(),
    ]
    subprocess.run(args, cwd=ROOT, check=True, env={**os.environ, "PYTHONHASHSEED": "0"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="where to write (default: the source tree)")
    generate(parser.parse_args().out.resolve())


if __name__ == "__main__":
    main()
