"""Access to the captured NRI wire vectors in ``shared/reference/vectors``.

Each ``NN-name.hex`` file holds comment lines (``#``) describing one ttrpc message, then one line of
hex per mux frame: the exact bytes of that frame on the wire (8-byte mux header + payload). The
directory lives beside the repository, not in it; tests that need it are marked ``requires_vectors``
and skip when it is absent.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

VECTOR_DIR = Path(__file__).resolve().parents[2] / "shared" / "reference" / "vectors"

requires_vectors = pytest.mark.skipif(
    not VECTOR_DIR.is_dir(), reason=f"captured NRI wire vectors not found at {VECTOR_DIR}"
)

MUX_HEADER = struct.Struct(">II")  # conn_id, length
TTRPC_HEADER = struct.Struct(">IIBB")  # length, stream_id, type, flags


def vector_path(name: str) -> Path:
    """Path of a vector file; ``name`` may omit ``.hex`` or be just the number prefix ("05")."""
    if name.endswith(".hex"):
        return VECTOR_DIR / name
    exact = VECTOR_DIR / f"{name}.hex"
    if exact.exists():
        return exact
    matches = sorted(VECTOR_DIR.glob(f"{name}-*.hex"))
    if len(matches) != 1:
        raise FileNotFoundError(f"no single vector file matches {name!r} in {VECTOR_DIR}")
    return matches[0]


def vector_names() -> list[str]:
    """File names of all vectors, sorted; empty when the directory is absent."""
    if not VECTOR_DIR.is_dir():
        return []
    return sorted(p.name for p in VECTOR_DIR.glob("*.hex"))


def comment_lines(name: str) -> list[str]:
    """The ``#`` lines of a vector file, without the leading ``#`` and surrounding blanks."""
    lines = vector_path(name).read_text(encoding="ascii").splitlines()
    return [line[1:].strip() for line in lines if line.startswith("#")]


def load_frames(name: str) -> list[bytes]:
    """The mux frames of a vector file, each as on the wire (8-byte mux header included)."""
    lines = vector_path(name).read_text(encoding="ascii").splitlines()
    return [bytes.fromhex(line.strip()) for line in lines if line.strip() and not line.startswith("#")]


def stream_bytes(name: str) -> bytes:
    """Everything one side wrote for this message: the concatenation of its frames."""
    return b"".join(load_frames(name))


def ttrpc_message(name: str) -> tuple[int, bytes]:
    """(mux connection id, whole ttrpc message) of a vector, checking each mux header's length."""
    conn_ids: set[int] = set()
    parts: list[bytes] = []
    for frame in load_frames(name):
        conn_id, length = MUX_HEADER.unpack_from(frame)
        if length != len(frame) - MUX_HEADER.size:
            raise ValueError(f"{name}: mux header announces {length} bytes, frame has {len(frame) - 8}")
        conn_ids.add(conn_id)
        parts.append(frame[MUX_HEADER.size :])
    if len(conn_ids) != 1:
        raise ValueError(f"{name}: frames of one message on several connections {sorted(conn_ids)}")
    return conn_ids.pop(), b"".join(parts)


def ttrpc_parts(name: str) -> tuple[int, int, int, bytes]:
    """(stream id, message type, flags, data) of a vector's ttrpc message, checking its length."""
    _, message = ttrpc_message(name)
    length, stream_id, msg_type, flags = TTRPC_HEADER.unpack_from(message)
    data = message[TTRPC_HEADER.size :]
    if length != len(data):
        raise ValueError(f"{name}: ttrpc header announces {length} bytes, message has {len(data)}")
    return stream_id, msg_type, flags, data
