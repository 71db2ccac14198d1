"""The state dir's format version: ``<state_dir>/state-format``, checked before the books are read.

The state dir holds the pod quota books (``books.sqlite``, with its ``-wal`` and ``-shm``), the
marker key and the lock. Their layout has a format number, `STATE_FORMAT`, written in
``state-format`` as JSON: ``{"format": 2, "written_by": "mixed-cpu-nri-plugin 0.3.0 (commit ...)"}``.
It says nothing of what the records hold (the database carries its own schema version); it is
raised only when a newer daemon lays the state dir out in a way an older one would misread, so that
the older one refuses to start instead of reading it wrong: a daemon rolled back keeps its hands off
books it cannot read, and says what to do.

* Format 1: the JSON books of 0.1.0 and 0.2.0 (``pod-quotas.json`` and its journals). No file: a
  state dir from 0.1.0 (which wrote none) or a new one. Both are read: the store moves the old
  books into the database (`nri_plugin.mixedcpu.store`), and the file is rewritten as format 2.
* Format 2 (this version): the books in ``books.sqlite``; the file is rewritten when another
  version wrote it.
* A higher format (a newer daemon's): `StateFormatError`, one line naming the version that wrote
  it and what to do. Nothing in the state dir is touched.
* A file that is not one we write (not JSON, no positive integer format, a link, too large):
  `StateFormatError` too; a person must look, since what wrote it is not known.

A daemon of format 1 (0.2.0) rolled back onto a format-2 state dir refuses it, as above, and tells
to remove ``state-format``: it then starts from empty books, which Synchronize rebuilds, and leaves
``books.sqlite`` alone; a later upgrade moves its newer ``pod-quotas.json`` into the database again.

A state dir that cannot be written (mounted read-only) is still checked; the daemon goes on without
the record, with a warning (the books, which must be written, say what is wrong with it).

The file is read as the marker key is (`nri_plugin.common.smallfile`: no link followed, regular
file, size bounded) and written atomically.
"""

from __future__ import annotations

import json
import os
from typing import Final

from nri_plugin.common.atomicfile import write_atomically
from nri_plugin.common.smallfile import RefusedFile, read_small_file

__all__ = [
    "STATE_FORMAT",
    "STATE_FORMAT_FILE",
    "StateFormatError",
    "read_state_format",
    "settle_state_format",
]

STATE_FORMAT_FILE: Final = "state-format"
# 1: 0.1.0's and 0.2.0's layout (pod-quotas.json, its journals, device-plugin-hmac.key, daemon.lock);
# 2: the books in books.sqlite (read from format 1 too: they are moved into the database).
STATE_FORMAT: Final = 2
_MAX_SIZE: Final = 4096


class StateFormatError(Exception):
    """The state dir is of a format this daemon does not read; the message says what to do."""


def read_state_format(state_dir: str) -> tuple[int, str] | None:
    """(format, who wrote it) from `state_dir`'s ``state-format``; None when there is none. Raises
    `StateFormatError` when the file is not one a daemon writes."""
    path = os.path.join(state_dir, STATE_FORMAT_FILE)
    try:
        data = json.loads(read_small_file(path, _MAX_SIZE))
    except FileNotFoundError:
        return None
    except (RefusedFile, OSError, ValueError) as exc:
        raise StateFormatError(f"{path}: unreadable ({_reason(exc)}); {_FIX_UNKNOWN}") from None
    number = data.get("format") if isinstance(data, dict) else None
    if not isinstance(number, int) or isinstance(number, bool) or number < 1:
        raise StateFormatError(f"{path}: no format number in it; {_FIX_UNKNOWN}")
    written_by = data.get("written_by")
    return number, written_by if isinstance(written_by, str) else "an unknown version"


_FIX_UNKNOWN = (
    "it was not written by mixed-cpu-nri-plugin; if this version wrote the rest of the state dir, "
    "remove the file and start again"
)


def _reason(exc: BaseException) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__


def settle_state_format(state_dir: str, running: str) -> bool:
    """Check `state_dir`'s format before anything in it is read, and record it as `running` (this
    daemon's ``version_line``) writes it. True when the file was (re)written. Raises
    `StateFormatError` for a newer format (or an unknown file), OSError when it cannot be written."""
    found = read_state_format(state_dir)
    if found is not None and found[0] > STATE_FORMAT:
        number, written_by = found
        raise StateFormatError(
            f"{state_dir} is in state format {number}, written by {written_by}; this {running} reads "
            f"format {STATE_FORMAT} only: run that version (or a later one) again; or, to go back to "
            f"this one, remove {os.path.join(state_dir, 'books.sqlite')}* and {STATE_FORMAT_FILE} "
            "there: the books are then rebuilt from the running containers, as after a lost state dir"
        )
    if found == (STATE_FORMAT, running):
        return False
    text = json.dumps({"format": STATE_FORMAT, "written_by": running}, sort_keys=True) + "\n"
    write_atomically(os.path.join(state_dir, STATE_FORMAT_FILE), text.encode(), mode=0o600)
    return True
