"""Text from a peer, made fit to keep: capped in length and with its control characters escaped.

kubelet and the API server send strings we store, log, show in ``status`` and pass on (a
registration error, an API error's message, a claim's name in an error). Nothing bounds them: a
3 MB registration error would be stored, logged and shown whole, and a newline or an escape
sequence in one would forge log lines or drive a terminal. `clip` keeps the first `limit`
characters, writes each character that is not printable as its Python escape (``\\n``, ``\\x1b``,
``\\u2028``), and says how long the whole was when it cut.
"""

from __future__ import annotations

from typing import Final

__all__ = ["PEER_TEXT_LIMIT", "clip"]

# What the daemon keeps of one string from a peer: far more than any honest message needs.
PEER_TEXT_LIMIT: Final = 512


def clip(value: str, limit: int = PEER_TEXT_LIMIT) -> str:
    """`value` cut to `limit` characters, its non-printable characters escaped; a cut value ends in
    ``... (<n> characters)``."""
    head = value[:limit]
    if not head.isprintable():
        head = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in head)
    return head if len(value) <= limit else f"{head}... ({len(value)} characters)"
