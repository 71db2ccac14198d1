"""Command line entry point (placeholder until the CLI lands)."""

from __future__ import annotations


def main() -> None:
    raise SystemExit("not implemented yet")
