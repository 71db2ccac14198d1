"""Command line: ``mixed-cpu-nri-plugin run | check | demo | version``."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, NoReturn

import structlog

from cgroups.mode import DEFAULT_MOUNTINFO
from nri_plugin import __version__
from nri_plugin.daemon.config import DEFAULT_CONFIG_PATH
from nri_plugin.daemon.logs import LEVELS, configure_logging, debug_toggle_on_sigusr1

__all__ = ["build_plugin", "load_marker_key", "main"]

if TYPE_CHECKING:
    from cgroups import CgroupLayout
    from nri_plugin.daemon.config import Config
    from nri_plugin.deviceplugin.marker import HostKey
    from nri_plugin.mixedcpu.plugin import MixedCpuPlugin
    from nri_plugin.nri.stub import Stub


_PROG: Final = "mixed-cpu-nri-plugin"


class _Parser(argparse.ArgumentParser):
    """An argument error is one line on stderr (exit 2), with where to read more."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}; see '{self.prog} --help'\n")


def _log_level_option(parser: argparse.ArgumentParser, default: str | None) -> None:
    parser.add_argument(
        "--log-level",
        choices=LEVELS,
        metavar="LEVEL",
        default=default,
        help="debug, info, warning or error (default: the config's log_level for run, warning for check "
        "and version, error for demo)",
    )


_RUN_EPILOG: Final = f"""\
The config file sets the shared CPUs (shared_cpuset) and where the NRI socket, the cgroup tree,
the state directory and kubelet's device-plugin directory are; `{_PROG} check`
tells whether they suit this node. Options given here win over the config.

Signals: SIGTERM or SIGINT closes the connection and exits 0 (a second one exits at once); SIGUSR1
turns debug logging on, and the next one turns it back off.

Exit status: 0 after a signal, 1 when the runtime cannot be served (e.g. --no-reconnect and the
connection is lost), 2 when the config is wrong (one line names the file, the key and the fix)."""

_CHECK_EPILOG: Final = """\
Each line is OK, WARN or FAIL, with a fix under each WARN and FAIL. Checked: the config file, the
shared CPUs online with some left over, the NRI socket, the cgroup mode and kubelet's cgroup driver,
the state directory, kubelet's device-plugin directory, and, with --kubelet-config, that kubelet
reserves the shared CPUs (reservedSystemCPUs) and runs the static CPU manager policy.

Exit status: 0 when nothing FAILs (warnings included), 1 otherwise."""


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=_PROG,
        description="NRI plugin giving containers with exclusive CPUs a node-wide pool of shared CPUs. "
        "'run' is the node daemon (NRI plugin and kubelet device plugin); 'check' tells whether a node "
        "is ready for it; 'demo' shows it at work against a built-in runtime simulator.",
        epilog=f"'{_PROG} COMMAND --help' describes each command.",
    )
    _log_level_option(parser, None)
    # The same option after the command name; SUPPRESS keeps a value given before it.
    level = _Parser(add_help=False)
    _log_level_option(level, argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser(
        "run",
        parents=[level],
        help="run the daemon: the NRI plugin against the node's runtime, and the kubelet device plugin",
        description="Run the daemon: serve the container runtime over NRI (cpuset, CFS quota and\n"
        "environment of containers that ask for shared CPUs) and, when [device_plugin] is enabled,\n"
        "the kubelet device plugin that advertises the resource those containers ask for.",
        epilog=_RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument(
        "--config",
        default=DEFAULT_CONFIG_PATH,
        metavar="PATH",
        help=f"the TOML config file (default: {DEFAULT_CONFIG_PATH}); it sets shared_cpuset",
    )
    run.add_argument(
        "--socket", default=None, metavar="PATH", help="NRI socket (default: the config's nri_socket)"
    )
    run.add_argument(
        "--nri-plugin-name",
        default=None,
        metavar="NAME",
        help="plugin name (default: NRI_PLUGIN_NAME, else the config's plugin_name)",
    )
    run.add_argument(
        "--nri-plugin-index",
        default=None,
        metavar="NN",
        help="two-digit plugin index (default: NRI_PLUGIN_IDX, else the config's plugin_index)",
    )
    run.add_argument(
        "--no-reconnect", action="store_true", help="exit when the runtime closes the connection"
    )

    check = commands.add_parser(
        "check",
        parents=[level],
        help="check the config and this node (NRI socket, cgroups, kubelet) and print a report",
        description="Check the config file and whether this node is ready for the daemon, without\n"
        "changing anything, and print one line per check.",
        epilog=_CHECK_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check.add_argument(
        "--config",
        default=DEFAULT_CONFIG_PATH,
        metavar="PATH",
        help=f"the TOML config file to check (default: {DEFAULT_CONFIG_PATH})",
    )
    check.add_argument(
        "--kubelet-config",
        default=None,
        metavar="PATH",
        help="kubelet's KubeletConfiguration YAML file (its --config flag, often "
        "/var/lib/kubelet/config.yaml): checks that reservedSystemCPUs holds the shared CPUs",
    )
    check.add_argument(
        "--mountinfo",
        default=DEFAULT_MOUNTINFO,
        metavar="PATH",
        help=f"where to read the cgroup mounts when cgroup_version is auto (default: {DEFAULT_MOUNTINFO})",
    )

    demo = commands.add_parser(
        "demo",
        parents=[level],
        help="run the plugin against the built-in NRI runtime simulator and show what it did",
        description="Run the real plugin against the built-in NRI runtime simulator, in a temporary "
        "directory with a fake cgroup tree, and print each step: no runtime, kubelet or root needed.",
    )
    demo.add_argument(
        "--runtime",
        choices=("containerd", "cri-o"),
        default="containerd",
        help="which runtime the simulator pretends to be (default: containerd)",
    )
    commands.add_parser(
        "version", parents=[level], help="print the version", description="Print the version and exit."
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The console script. Every error is one line on stderr, never a traceback (with
    --log-level debug, an unexpected one is also logged with its traceback)."""
    args = _parser().parse_args(argv)
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        structlog.get_logger("nri_plugin.daemon.cli").debug("unexpected error", exc_info=True)
        text = " ".join(str(exc).split()) or "(no message)"
        print(
            f"error: unexpected {type(exc).__name__}: {text}; run again with --log-level debug to log the "
            "traceback, and report it",
            file=sys.stderr,
        )
        return 1


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "run":
        # Until the config is read: its log_level and log_format apply from then on.
        configure_logging(args.log_level or "info")
        return _run(args)
    # The demo prints what happens; the plugin's own refusal warnings would repeat it on stderr.
    configure_logging(args.log_level or ("error" if args.command == "demo" else "warning"))
    if args.command == "version":
        print(f"{_PROG} {__version__}")
        return 0
    if args.command == "check":
        from nri_plugin.daemon.check import run_checks

        report = run_checks(args.config, kubelet_config=args.kubelet_config, mountinfo_path=args.mountinfo)
        print(report.render())
        return report.exit_code
    from nri_plugin.daemon.demo import run_demo

    version = "v2.3.4" if args.runtime == "containerd" else "v1.36.3"
    return asyncio.run(run_demo(sys.stdout, runtime_name=args.runtime, runtime_version=version))


def load_marker_key(config: Config) -> HostKey | None:
    """The node's marker key when the config trusts the device-plugin marker. Raises `HostKeyError`."""
    from nri_plugin.deviceplugin.marker import HostKey

    return HostKey.load_or_create(config.state_dir) if config.trust_device_plugin_marker else None


def build_plugin(config: Config, layout: CgroupLayout, marker_key: HostKey | None) -> MixedCpuPlugin:
    """The mixed-CPU plugin as `config` describes it (`MixedCpuPlugin.from_config` until now)."""
    from nri_plugin.mixedcpu.plugin import MixedCpuPlugin
    from nri_plugin.mixedcpu.store import StateStore

    return MixedCpuPlugin(
        shared=config.shared_cpuset,
        layout=layout,
        store=StateStore(config.state_dir),
        marker_key=marker_key,
        trust_pod_annotation=config.trust_pod_annotation,
    )


def _run(args: argparse.Namespace) -> int:
    """Load and check the config (exit 2 with one line when it is wrong), then serve until signalled."""
    from nri_plugin.daemon.config import ConfigError, build_layout, load_config
    from nri_plugin.deviceplugin.marker import HostKeyError
    from nri_plugin.nri.stub import Stub, StubError

    try:
        config = load_config(args.config)
        # For good: each logger is cached at its first use (the level still follows SIGUSR1).
        configure_logging(args.log_level or config.log_level, config.log_format, cache_loggers=True)
        layout = build_layout(config)
        try:
            key = load_marker_key(config)
            plugin = build_plugin(config, layout, key)
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
    log = structlog.get_logger("nri_plugin.daemon.cli")
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
    return asyncio.run(_serve_toggling_debug(stub, config, key))


async def _serve_toggling_debug(stub: Stub, config: Config, key: HostKey | None) -> int:
    """`_serve`, with SIGUSR1 toggling debug logging meanwhile."""
    with debug_toggle_on_sigusr1(asyncio.get_running_loop()):
        status = await _serve(stub, config, key)
    await _let_leftover_tasks_finish(DRAIN_SECONDS)
    return status


# After shutdown, how long tasks we did not start (grpc's per-RPC tasks) may take to end by themselves.
DRAIN_SECONDS = 1.0


async def _let_leftover_tasks_finish(seconds: float) -> None:
    """Give tasks still running after shutdown a moment to end on their own.

    grpc.aio keeps a task per RPC that ends only once its core reports the call closed, a few loop
    turns after the server stopped. `asyncio.run` would cancel such a task at once, and grpc then
    prints a bare CancelledError traceback on stderr: a clean stop that looks like a crash.
    """
    current = asyncio.current_task()
    leftover = {task for task in asyncio.all_tasks() if task is not current}
    if leftover:
        await asyncio.wait(leftover, timeout=seconds)


async def _serve(stub: Stub, config: Config, key: HostKey | None) -> int:
    """The NRI plugin and, when enabled, the kubelet device plugin, in one loop until signalled.

    The device plugin runs beside the NRI side, not in front of it: while kubelet is away (or refuses
    us) it keeps retrying on its own, and the NRI side goes on serving the runtime.
    """
    from nri_plugin.deviceplugin.server import DevicePluginServer
    from nri_plugin.nri.stub import StubError, run_until_signalled

    device_plugin = None
    if config.device_plugin.enabled and key is not None:
        device_plugin = DevicePluginServer(config.device_plugin, key)
    probes = None
    if config.metrics_address:
        # Metrics and probes on the same loop: a wedged loop fails liveness.
        from nri_plugin.daemon.metrics import Metrics
        from nri_plugin.daemon.probes import ProbeError, ProbeServer, readiness

        metrics = Metrics()
        metrics.attach(stub, device_plugin)
        try:
            probes = ProbeServer(
                config.metrics_address, metrics=metrics.render, readiness=readiness(stub, device_plugin)
            )
            await probes.start()
        except ProbeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    if device_plugin is not None:
        await device_plugin.start()
    try:
        await run_until_signalled(stub)
    except StubError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if device_plugin is not None:
            await device_plugin.close()
        if probes is not None:
            await probes.close()
        flush = getattr(stub.plugin, "flush", None)
        if callable(flush):
            try:
                flush()
            except OSError as exc:
                print(f"error: cannot save the plugin's state: {exc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
