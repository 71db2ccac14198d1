"""Access to the NRI wire vectors captured from the Go implementation, kept in ``tests/data/vectors``.

Each ``NN-name.hex`` file holds comment lines (``#``) describing one ttrpc message, then one line of
hex per mux frame: the exact bytes of that frame on the wire (8-byte mux header + payload). They are
the contract with containerd/nri, so they live in the repository: a missing vector fails the tests
that read it (``EXPECTED_VECTORS`` lists every file), it never skips them.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Final

VECTOR_DIR = Path(__file__).resolve().parent / "data" / "vectors"

EXPECTED_VECTORS: Final = (
    "01-register-request.hex",
    "02-register-reply-ok.hex",
    "03-configure-request.hex",
    "04-configure-response.hex",
    "05-synchronize-request.hex",
    "06-synchronize-response.hex",
    "07-create-container-request.hex",
    "08-create-container-response.hex",
    "09-update-container-request.hex",
    "10-error-reply.hex",
    "11-unknown-method-request.hex",
    "12-unimplemented-reply.hex",
    "13-large-request-5000.hex",
    "14-large-request-10000.hex",
    "21-dossier-v1-register-request.hex",
    "22-dossier-v2-register-reply-ok.hex",
    "23-dossier-v3-configure-response.hex",
    "24-dossier-v4-unimplemented-reply.hex",
    "25-dossier-v5-configure-request.hex",
    "26-dossier-v6-create-container-response.hex",
    "27-dossier-v7-synchronize-more-response.hex",
    "28-dossier-v8-large-request-5000.hex",
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
    """File names of all vectors, sorted: `EXPECTED_VECTORS`, whether or not the files are there (a
    test reading a missing one fails)."""
    return list(EXPECTED_VECTORS)


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
