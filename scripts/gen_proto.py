#!/usr/bin/env python3
"""Regenerate the committed Python modules of every .proto file under nri_plugin/api/.

Usage: python scripts/gen_proto.py [--out DIR]

Every proto gets *_pb2.py and *_pb2.pyi. Protos under nri_plugin/api/:
deviceplugin/, podresources/, pluginregistration/, dra/ and drahealth/
(kubelet's device-plugin, pod-resources, plugin-registration and DRA APIs,
spoken over gRPC) also get *_pb2_grpc.py and *_pb2_grpc.pyi; the others are
spoken over ttrpc and need messages only.

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
# Protos whose services are served or called over gRPC (grpcio) rather than ttrpc.
GRPC_DIRS = (
    "nri_plugin/api/deviceplugin/",
    "nri_plugin/api/podresources/",
    "nri_plugin/api/pluginregistration/",
    "nri_plugin/api/dra/",
    "nri_plugin/api/drahealth/",
)


def proto_files() -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "nri_plugin" / "api").rglob("*.proto"))


def is_grpc(proto: str) -> bool:
    return proto.startswith(GRPC_DIRS)


def generate(out: Path) -> None:
    import grpc_tools

    bundled = Path(grpc_tools.__file__).parent / "_proto"
    bindir = Path(sys.executable).parent
    out.mkdir(parents=True, exist_ok=True)
    base = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        "-I",
        str(ROOT),
        "-I",
        str(bundled),
        f"--python_out={out}",
        f"--mypy_out={out}",
        f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
    ]
    # The gRPC generators write a *_pb2_grpc module for every file they are given, services or not,
    # so the gRPC protos go through a protoc run of their own.
    grpc_extra = [
        f"--grpc_python_out={out}",
        f"--mypy_grpc_out={out}",
        f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
    ]
    protos = proto_files()
    for args, files in (
        (base, [p for p in protos if not is_grpc(p)]),
        (base + grpc_extra, [p for p in protos if is_grpc(p)]),
    ):
        if files:
            subprocess.run([*args, *files], cwd=ROOT, check=True, env={**os.environ, "PYTHONHASHSEED": "0"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="where to write (default: the source tree)")
    generate(parser.parse_args().out.resolve())


if __name__ == "__main__":
    main()
