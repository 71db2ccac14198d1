"""Command line: ``mixed-cpu-nri-plugin run | status | check | config | demo | enable-nri | version``.

Parsing the arguments and printing failures is all this module does: ``run`` is
`nri_plugin.daemon.wiring.build_daemon` (the parts, from the config) and `Daemon.run`
(`nri_plugin.daemon.app`: signals, shutdown, exit status).

Output that nobody reads any more (``demo | head -1``) ends the command quietly with the status a
command killed by SIGPIPE has, `EXIT_OUTPUT_CLOSED`, as ``cat`` or ``grep`` would; it is no error
to report.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import select
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Final, NoReturn

import structlog

from nri_plugin.cgroups.mode import DEFAULT_MOUNTINFO
from nri_plugin.common.buildinfo import PROGRAM, version_line
from nri_plugin.daemon.config import DEFAULT_CONFIG_PATH, DEFAULT_STATE_DIR
from nri_plugin.daemon.logs import LEVELS, configure_logging

__all__ = ["EXIT_OUTPUT_CLOSED", "main"]


_PROG: Final = PROGRAM
# The status of a command whose reader went away (a shell shows a SIGPIPE death as 128 + 13).
EXIT_OUTPUT_CLOSED: Final = 128 + signal.SIGPIPE
# demo --runtime: the simulated runtime's name, and its version; "crio" is CRI-O's command name.
_DEMO_RUNTIMES: Final = {"containerd": ("containerd", "v2.3.4"), "cri-o": ("cri-o", "v1.36.3")}
_DEMO_RUNTIME_ALIASES: Final = {"crio": "cri-o"}


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

Signals: SIGTERM, SIGINT or SIGHUP closes the connection, saves the state and exits 0 (a second one
exits at once, with status 128 + its number). SIGHUP does not reload: the config is read at start,
so restart the daemon to apply a change (under systemd or in a pod, the restart after SIGHUP does).
SIGUSR1 turns debug logging on, and the next one turns it back off.

Exit status: 0 after a signal; 1 when the runtime cannot be served (e.g. --no-reconnect and the
connection is lost, or the runtime that started the plugin closed its connection); 2 when what is
configured is wrong: the config file, --nri-plugin-name, --nri-plugin-index, NRI_PLUGIN_NAME,
NRI_PLUGIN_IDX, or a metrics_address that cannot be listened on (one line names which, and the
fix). A systemd unit should not restart the daemon after 2."""

_CHECK_EPILOG: Final = """\
Each line is OK, WARN or FAIL, with a fix under each WARN and FAIL. Checked: the config file, the
shared CPUs online with some left over, the NRI socket (that the runtime accepts a connection on
it), the cgroup mode and kubelet's cgroup driver, the state directory (only root may write it),
kubelet's device-plugin directory, and, with --kubelet-config, that kubelet reserves the shared
CPUs (reservedSystemCPUs) and runs the static CPU manager policy. A config error is the first
FAIL, and the node is still checked: with the config's valid keys, or with the defaults when there
is no config file or it is no TOML; the report says which.

The connection to the NRI socket is closed at once; the runtime may log it as a plugin that did
not register.

Exit status: 0 when nothing FAILs (warnings included), 1 otherwise."""

_CONFIG_EPILOG: Final = f"""\
Only the file is read: '{_PROG} check' tells whether the config suits this node. run's own
options (--socket, --nri-plugin-name, --nri-plugin-index, --log-level) win over what is printed.
With --defaults no file is read: every key at its default, shared_cpuset (required) commented out.

Exit status: 0 when printed; 2 when run would refuse the config (one line names the key and the fix)."""


_STATUS_EPILOG: Final = f"""\
The socket is <state_dir>/status.sock, mode 0600: run the command as root on the node, or inside the
daemon's own pod (the image has no shell; this needs none):
  kubectl exec -n <namespace> ds/<daemonset> -- {_PROG} status
On a node without a config file (the DaemonSet keeps its config in the pod), the daemon is asked in
the default state_dir, {DEFAULT_STATE_DIR}, where the chart and the manifests mount it; --state-dir
or --socket names another. docs/status.md describes every field of --output json.

Exit status: 0 when the daemon answered, 1 when it cannot be asked (not running, or not root: one
line says which, and the fix), 2 when the config file given cannot be read."""


def _positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0.1 <= seconds <= 86400:
        raise argparse.ArgumentTypeError(f"{text} is not between 0.1 and 86400 seconds")
    return seconds


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=_PROG,
        description="NRI plugin giving containers with exclusive CPUs a node-wide pool of shared CPUs. "
        "'run' is the node daemon (NRI plugin and kubelet device plugin); 'check' tells whether a node "
        "is ready for it; 'demo' shows it at work against a built-in runtime simulator.",
        epilog=f"'{_PROG} COMMAND --help' describes each command.",
    )
    _log_level_option(parser, None)
    parser.add_argument("--version", action="version", version=version_line())
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
        help="plugin name (default: NRI_PLUGIN_NAME, else an NN-name executable's, else config)",
    )
    run.add_argument(
        "--nri-plugin-index",
        default=None,
        metavar="NN",
        help="two-digit plugin index (default: NRI_PLUGIN_IDX, else an NN-name executable's, else config)",
    )
    run.add_argument(
        "--no-reconnect", action="store_true", help="exit when the runtime closes the connection"
    )

    status = commands.add_parser(
        "status",
        parents=[level],
        help="ask the running daemon who holds the shared CPUs now, and why",
        description="Ask the running daemon, on its root-only status socket in state_dir, and print its\n"
        "runtime connection, device plugin and kubelet record, the shared pool, one row per container\n"
        "holding shared CPUs (with what proved its request, and for how long), each pod's CFS quota now\n"
        "against its target and baseline, and the latest heals.",
        epilog=_STATUS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = status.add_mutually_exclusive_group()
    where.add_argument(
        "--config",
        default=None,
        metavar="PATH",
        help=f"the daemon's config file, which names its state_dir (default: {DEFAULT_CONFIG_PATH} when "
        f"there is one, else the default state_dir, {DEFAULT_STATE_DIR})",
    )
    where.add_argument(
        "--state-dir",
        default=None,
        metavar="DIR",
        help="the daemon's state_dir, where its status socket is (e.g. the chart's hostPaths.stateDir)",
    )
    where.add_argument(
        "--socket",
        default=None,
        metavar="PATH",
        help="the daemon's status socket itself (<state_dir>/status.sock)",
    )
    status.add_argument(
        "--output",
        "-o",
        choices=("table", "json"),
        default="table",
        help="table (default), or json: the documented schema mixed-cpu-nri-plugin/status/v1",
    )
    status.add_argument(
        "--watch",
        nargs="?",
        type=_positive_seconds,
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="ask again every SECONDS (default 2) until interrupted; with --output json, one line each",
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

    # A command of its own, not an option of check: its standard output is nothing but a config
    # file (`config > file` is one run takes), it reads nothing but the file, and it exits 2 on a
    # config error as run does, where check prints a report, probes the node and exits 1.
    config = commands.add_parser(
        "config",
        parents=[level],
        help="print the effective config: every key, its value and where it comes from, as TOML",
        description="Print every key of the config as the daemon would use it, as TOML that\n"
        "'run --config' takes back, each value's origin in a comment beside it: file, default, or\n"
        "environment (NRI_PLUGIN_NAME, NRI_PLUGIN_IDX) or executable name (an NN-name file),\n"
        "which win over the file, as for run.",
        epilog=_CONFIG_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = config.add_mutually_exclusive_group()
    source.add_argument(
        "--config",
        default=DEFAULT_CONFIG_PATH,
        metavar="PATH",
        help=f"the TOML config file (default: {DEFAULT_CONFIG_PATH})",
    )
    source.add_argument(
        "--defaults",
        action="store_true",
        help="read no file: print every key's default (shared_cpuset, which has none, commented out)",
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
        choices=(*_DEMO_RUNTIMES, *_DEMO_RUNTIME_ALIASES),
        default="containerd",
        help="which runtime the simulator pretends to be: containerd or cri-o (also crio; default: "
        "containerd)",
    )
    demo.add_argument(
        "--keep",
        action="store_true",
        help="keep the demo's temporary directory (config, cgroup tree, state file) and print where",
    )
    demo.add_argument(
        "--dra",
        action="store_true",
        help="ask through DRA instead: a claim prepared by the DRA kubelet plugin, the container "
        "created with its CDI device, the shared CPUs granted",
    )
    enable = commands.add_parser(
        "enable-nri",
        parents=[level],
        help="turn NRI on in the node's runtime config and restart the runtime (the chart's init container)",
        description="Turn NRI on in containerd's config.toml or with a CRI-O drop-in, under --host-root,\n"
        "and restart the runtime over systemd's D-Bus; nothing at all when the runtime already\n"
        "accepts connections on its NRI socket. For the Helm chart's opt-in init container\n"
        "(nri.runtime.patchConfig); by hand, packaging/runtime/ has the drop-ins to install.",
        epilog="Exit status: 0 when NRI is on (or turned on and the runtime restarting), 1 when a file could "
        "not be written or the runtime could not be restarted, 2 when the config cannot be changed safely "
        "(unreadable, a link out of --host-root or to nothing, no runtime config directory under "
        "--host-root).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    enable.add_argument(
        "--runtime", choices=("containerd", "cri-o"), required=True, help="the node's runtime"
    )
    enable.add_argument(
        "--host-root",
        default="/host",
        metavar="PATH",
        help="where the host's /etc/containerd (or /etc/crio), /var/run/nri and /run/dbus are mounted "
        "(default: /host)",
    )
    commands.add_parser(
        "version",
        parents=[level],
        help="print the version",
        description="Print the version and the commit it was built from, and exit.",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The console script. Every error is one line on stderr, never a traceback (with
    --log-level debug, an unexpected one is also logged with its traceback)."""
    args = _parser().parse_args(argv)
    try:
        status = _dispatch(args)
        sys.stdout.flush()  # here, not at exit, so that a closed pipe is seen below
        return status
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        _discard_stdout()
        return EXIT_OUTPUT_CLOSED
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
    return _COMMANDS[args.command](args)


def _version(_args: argparse.Namespace) -> int:
    print(version_line())
    return 0


def _enable_nri(args: argparse.Namespace) -> int:
    from nri_plugin.daemon.enable_nri import enable_nri

    return enable_nri(args.runtime, host_root=args.host_root)


def _status(args: argparse.Namespace) -> int:
    from nri_plugin.daemon.status_client import run_status

    return run_status(
        args.config, state_dir=args.state_dir, socket=args.socket, output=args.output, watch=args.watch
    )


def _check(args: argparse.Namespace) -> int:
    from nri_plugin.daemon.check import run_checks

    report = run_checks(args.config, kubelet_config=args.kubelet_config, mountinfo_path=args.mountinfo)
    print(report.render())
    return report.exit_code


def _demo(args: argparse.Namespace) -> int:
    from nri_plugin.daemon.demo import run_demo

    name, version = _DEMO_RUNTIMES[_DEMO_RUNTIME_ALIASES.get(args.runtime, args.runtime)]
    if args.dra:
        from nri_plugin.daemon.demo_dra import run_dra_demo

        if args.keep:
            print(
                "demo: --keep is for the device-plugin demo; the DRA demo removes its directory",
                file=sys.stderr,
            )
            return 2
        return asyncio.run(run_dra_demo(sys.stdout, runtime_name=name, runtime_version=version))
    return asyncio.run(run_demo(sys.stdout, runtime_name=name, runtime_version=version, keep=args.keep))


def _config(args: argparse.Namespace) -> int:
    """Print the effective config (`nri_plugin.daemon.effective`), or the defaults; a config error
    is one line, exit 2."""
    from nri_plugin.daemon.config import ConfigError, ConfigMissing
    from nri_plugin.daemon.effective import config_command

    try:
        text = config_command(None if args.defaults else args.config, executable=sys.argv[0])
    except ConfigMissing as exc:
        print(f"error: {exc}; '{_PROG} config --defaults' prints every key's default", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


# Every command but run, by name (each imports what it needs only when it runs).
_COMMANDS: Final[dict[str, Callable[[argparse.Namespace], int]]] = {
    "version": _version,
    "enable-nri": _enable_nri,
    "config": _config,
    "status": _status,
    "check": _check,
    "demo": _demo,
}


def _stdout_closed() -> bool:
    """True when nobody reads our standard output any more (the reader of its pipe has gone)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _discard_stdout() -> None:
    """Point standard output at /dev/null, so that what is still buffered, flushed at exit, goes
    nowhere instead of raising once more."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def _run(args: argparse.Namespace) -> int:
    """Build the daemon from its config and serve until signalled; a failure is one line (exit 2 for a
    config error, 1 when the runtime cannot be served; see ``run --help``)."""
    from nri_plugin.daemon.app import DaemonError
    from nri_plugin.daemon.wiring import RunOptions, build_daemon

    options = RunOptions(
        config_path=args.config,
        socket=args.socket,
        plugin_name=args.nri_plugin_name,
        plugin_index=args.nri_plugin_index,
        reconnect=not args.no_reconnect,
        log_level=args.log_level,
        node_lock=True,
        executable=sys.argv[0],
    )
    if os.geteuid() != 0:
        structlog.get_logger("nri_plugin.daemon.cli").warning(
            "you are not root",
            uid=os.geteuid(),
            why="the daemon writes cgroup files, kubelet's device-plugin directory and its state dir",
            fix=f"run it as root; see what uid {os.geteuid()} lacks with: mixed-cpu-nri-plugin check "
            f"--config {args.config}",
        )
    try:
        return build_daemon(options).run()
    except DaemonError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.status


if __name__ == "__main__":
    sys.exit(main())
