"""Kubernetes' name rules, as its API server applies them: the DNS-1123 label and subdomain.

A label is 1-63 lowercase letters, digits and '-', starting and ending with a letter or digit
(namespaces, DRA device and request names). A subdomain is labels joined by '.', at most 253
characters in all, or fewer where a field says so (a DRA driver name: 63). Pure; no I/O.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["LABEL_MAX", "SUBDOMAIN_MAX", "is_dns_label", "is_dns_subdomain"]

LABEL_MAX: Final = 63
SUBDOMAIN_MAX: Final = 253
_LABEL: Final = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_LABEL_RE: Final = re.compile(_LABEL)
_SUBDOMAIN_RE: Final = re.compile(rf"{_LABEL}(\.{_LABEL})*")


def is_dns_label(text: str) -> bool:
    """Whether `text` is a DNS-1123 label (at most 63 characters)."""
    return len(text) <= LABEL_MAX and _LABEL_RE.fullmatch(text) is not None


def is_dns_subdomain(text: str, max_length: int = SUBDOMAIN_MAX) -> bool:
    """Whether `text` is a DNS-1123 subdomain of at most `max_length` characters."""
    return len(text) <= max_length and _SUBDOMAIN_RE.fullmatch(text) is not None
