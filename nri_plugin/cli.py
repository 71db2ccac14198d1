"""Command line: ``mixed-cpu-nri-plugin run | demo | version``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

import structlog

from nri_plugin import __version__
from nri_plugin.stub import DEFAULT_SOCKET_PATH


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
        logger_factory=_stderr_logger,
    )


def _stderr_logger(*_args: object) -> structlog.PrintLogger:
    # Looked up at each use, not bound once: whoever replaces sys.stderr later is honoured.
    return structlog.PrintLogger(sys.stderr)


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
    run = commands.add_parser("run", help="run the NRI plugin against the node's container runtime")
    run.add_argument(
        "--socket", default=DEFAULT_SOCKET_PATH, help=f"NRI socket (default: {DEFAULT_SOCKET_PATH})"
    )
    run.add_argument(
        "--nri-plugin-name", default=None, help="plugin name (default: NRI_PLUGIN_NAME or mixed-cpu)"
    )
    run.add_argument(
        "--nri-plugin-index", default=None, help="two-digit plugin index (default: NRI_PLUGIN_IDX or 10)"
    )
    run.add_argument("--shared-cpus", required=True, help="the node's shared CPU pool, e.g. 0-1")
    run.add_argument(
        "--no-reconnect", action="store_true", help="exit when the runtime closes the connection"
    )
    commands.add_parser("version", help="print the version")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging(args.log_level)
    if args.command == "version":
        print(f"mixed-cpu-nri-plugin {__version__}")
        return 0
    if args.command == "run":
        return asyncio.run(_run(args))
    from nri_plugin.demo import run_demo

    version = "v2.3.4" if args.runtime == "containerd" else "v1.36.3"
    return asyncio.run(run_demo(sys.stdout, runtime_name=args.runtime, runtime_version=version))


async def _run(args: argparse.Namespace) -> int:
    import os

    from nri_plugin.demo import DemoPlugin
    from nri_plugin.stub import Stub, StubError, run_until_signalled

    try:
        stub = Stub(
            DemoPlugin(args.shared_cpus),
            name=args.nri_plugin_name or os.environ.get("NRI_PLUGIN_NAME") or "mixed-cpu",
            index=args.nri_plugin_index or os.environ.get("NRI_PLUGIN_IDX") or "10",
            socket_path=args.socket,
            reconnect=not args.no_reconnect,
        )
        await run_until_signalled(stub)
    except StubError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
