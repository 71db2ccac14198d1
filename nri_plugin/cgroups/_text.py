"""Quoting of untrusted text inside error messages."""

from __future__ import annotations

import json
from typing import Final

__all__ = ["QUOTE_LIMIT", "quote"]

# Error messages end up in logs and in replies to the runtime. Inputs come from the runtime or a
# config file and may be arbitrarily long, so only this many characters of one are echoed back.
QUOTE_LIMIT: Final = 120


def quote(text: str) -> str:
    """Double-quote `text` for a message: control and non-ASCII characters escaped, long text cut.

    Escaping makes a newline, a NUL or a look-alike such as U+FF0E visible instead of letting it
    blend into the message.
    """
    if len(text) <= QUOTE_LIMIT:
        return json.dumps(text)
    return f"{json.dumps(text[:QUOTE_LIMIT])}... ({len(text)} characters)"
