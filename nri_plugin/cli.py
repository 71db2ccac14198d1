"""Command line: ``mixed-cpu-nri-plugin demo | version``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

import structlog

from nri_plugin import __version__


def configure_logging(level: str) -> None:
    """Key-value lines on stderr at the given level (stdlib loggers included)."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise SystemExit(f"error: unknown log level {level!r}: use debug, info, warning or error")
    logging.basicConfig(level=numeric, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mixed-cpu-nri-plugin",
        description="NRI plugin giving containers with exclusive CPUs a node-wide pool of shared CPUs.",
    )
    parser.add_argument(
        "--log-level", default="warning", help="debug, info, warning or error (default: warning)"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser("demo", help="run the plugin against the built-in NRI runtime simulator")
    demo.add_argument(
        "--runtime",
        choices=("containerd", "cri-o"),
        default="containerd",
        help="which runtime the simulator pretends to be (default: containerd)",
    )
    commands.add_parser("version", help="print the version")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging(args.log_level)
    if args.command == "version":
        print(f"mixed-cpu-nri-plugin {__version__}")
        return 0
    from nri_plugin.demo import run_demo

    version = "v2.3.4" if args.runtime == "containerd" else "v1.36.3"
    return asyncio.run(run_demo(sys.stdout, runtime_name=args.runtime, runtime_version=version))


if __name__ == "__main__":
    sys.exit(main())
