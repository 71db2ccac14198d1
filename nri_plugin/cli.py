"""Command line: ``mixed-cpu-nri-plugin run | demo | version``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import structlog

from nri_plugin import __version__
from nri_plugin.config import DEFAULT_CONFIG_PATH

if TYPE_CHECKING:
    from nri_plugin.config import Config
    from nri_plugin.deviceplugin.marker import HostKey
    from nri_plugin.stub import Stub


def configure_logging(level: str, log_format: str = "console") -> None:
    """Lines on stderr at the given level (stdlib loggers included): key-value text, or JSON."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise SystemExit(f"error: unknown log level {level!r}: use debug, info, warning or error")
    logging.basicConfig(level=numeric, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer()
        if log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
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
        "--log-level",
        default=None,
        help="debug, info, warning or error (default: the config's log_level for run, warning otherwise)",
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
        "--config",
        default=DEFAULT_CONFIG_PATH,
        help=f"the TOML config file (default: {DEFAULT_CONFIG_PATH}); it sets shared_cpuset",
    )
    run.add_argument("--socket", default=None, help="NRI socket (default: the config's nri_socket)")
    run.add_argument(
        "--nri-plugin-name",
        default=None,
        help="plugin name (default: NRI_PLUGIN_NAME, else the config's plugin_name)",
    )
    run.add_argument(
        "--nri-plugin-index",
        default=None,
        help="two-digit plugin index (default: NRI_PLUGIN_IDX, else the config's plugin_index)",
    )
    run.add_argument(
        "--no-reconnect", action="store_true", help="exit when the runtime closes the connection"
    )
    commands.add_parser("version", help="print the version")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "run":
        return _run(args)
    # The demo prints what happens; the plugin's own refusal warnings would repeat it on stderr.
    configure_logging(args.log_level or ("error" if args.command == "demo" else "warning"))
    if args.command == "version":
        print(f"mixed-cpu-nri-plugin {__version__}")
        return 0
    from nri_plugin.demo import run_demo

    version = "v2.3.4" if args.runtime == "containerd" else "v1.36.3"
    return asyncio.run(run_demo(sys.stdout, runtime_name=args.runtime, runtime_version=version))


def _run(args: argparse.Namespace) -> int:
    """Load and check the config (exit 2 with one line when it is wrong), then serve until signalled."""
    from nri_plugin.config import ConfigError, build_layout, load_config
    from nri_plugin.deviceplugin.marker import HostKeyError
    from nri_plugin.mixedcpu import MixedCpuPlugin
    from nri_plugin.stub import Stub, StubError

    try:
        config = load_config(args.config)
        configure_logging(args.log_level or config.log_level, config.log_format)
        layout = build_layout(config)
        try:
            plugin = MixedCpuPlugin.from_config(config, layout)
        except (HostKeyError, OSError) as exc:
            raise ConfigError(
                f"{config.source}: state_dir: {exc}; point state_dir at a directory only root can write"
            ) from None
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        stub = Stub(
            plugin,
            name=args.nri_plugin_name or os.environ.get("NRI_PLUGIN_NAME") or config.plugin_name,
            index=args.nri_plugin_index or os.environ.get("NRI_PLUGIN_IDX") or config.plugin_index,
            socket_path=args.socket or config.nri_socket,
            reconnect=not args.no_reconnect,
        )
    except StubError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    log = structlog.get_logger("nri_plugin.cli")
    log.info(
        "starting",
        config=config.source,
        plugin=stub.identity.full_name,
        socket=stub.socket_path,
        shared_cpuset=config.shared_cpuset_text,
        cgroup_mode=layout.mode.value,
        cpu_hierarchy=layout.cpu.mount_point,
        trusted_sources=[
            name
            for name, on in (
                ("device-plugin-marker", config.trust_device_plugin_marker),
                ("pod-annotation", config.trust_pod_annotation),
            )
            if on
        ],
    )
    return asyncio.run(_serve(stub, config, plugin.marker_key))


async def _serve(stub: Stub, config: Config, key: HostKey | None) -> int:
    """The NRI plugin and, when enabled, the kubelet device plugin, in one loop until signalled.

    The device plugin runs beside the NRI side, not in front of it: while kubelet is away (or refuses
    us) it keeps retrying on its own, and the NRI side goes on serving the runtime.
    """
    from nri_plugin.deviceplugin import DevicePluginServer
    from nri_plugin.stub import StubError, run_until_signalled

    device_plugin = None
    if config.device_plugin.enabled and key is not None:
        device_plugin = DevicePluginServer(config.device_plugin, key)
        await device_plugin.start()
    try:
        await run_until_signalled(stub)
    except StubError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if device_plugin is not None:
            await device_plugin.close()
        flush = getattr(stub.plugin, "flush", None)
        if callable(flush):
            try:
                flush()
            except OSError as exc:
                print(f"error: cannot save the plugin's state: {exc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
