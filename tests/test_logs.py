"""Log lines: JSON off a terminal and text on one, stdlib loggers in the same format, the fields of a
line about a container, and SIGUSR1 turning debug logging on and off at run time."""

from __future__ import annotations

import asyncio
import datetime
import io
import json
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import structlog
from mixedcpu_support import (
    PERIOD,
    FakeCgroups,
    Naming,
    daemon_process,
    make_container,
    make_plugin,
    make_pod,
    marker,
    write_daemon_config,
)

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.daemon import logs as logs_module
from nri_plugin.daemon.logs import configure_logging, debug_toggle_on_sigusr1, resolve_format, toggle_debug
from nri_plugin.nri.simulator import RuntimeSimulator

GUARD = 20.0
log = structlog.get_logger("nri_plugin.test")


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """Each test configures logging its own way; leave the process as it was."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
    structlog.reset_defaults()


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines()]


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_json_lines_for_structlog_and_stdlib_loggers() -> None:
    out = io.StringIO()
    assert configure_logging("info", "json", stream=out) == "json"
    log.info("shared CPUs given", event_name="CreateContainer", cpus="0-3", count=2)
    log.debug("not at info")
    logging.getLogger("grpc._cython.cygrpc").warning("grpc says %s", "hello")
    logging.getLogger("grpc._cython.cygrpc").debug("not at info either")
    try:
        raise ValueError("bad value")
    except ValueError:
        log.exception("it failed")
    ours, grpc, failure = json_lines(out.getvalue())
    assert list(ours)[:5] == ["timestamp", "level", "logger", "msg", "event"]
    assert {k: v for k, v in ours.items() if k != "timestamp"} == {
        "level": "info",
        "logger": "nri_plugin.test",
        "msg": "shared CPUs given",
        "event": "CreateContainer",
        "cpus": "0-3",
        "count": 2,
    }
    assert ours["timestamp"].endswith("Z")
    assert {k: v for k, v in grpc.items() if k != "timestamp"} == {
        "level": "warning",
        "logger": "grpc._cython.cygrpc",
        "msg": "grpc says hello",
    }
    assert (failure["level"], failure["msg"]) == ("error", "it failed")
    assert failure["exception"].startswith("Traceback (most recent call last):")
    assert failure["exception"].endswith("ValueError: bad value")


class _Shown:
    def __repr__(self) -> str:
        return "<shown>"


class _Structured:
    def __structlog__(self) -> list[int]:
        return [1, 2]


def _reference_logger(name: str) -> Any:
    """A logger through structlog's configured processor chain and a stdlib record: the long way a
    JSON line went before it was rendered in one step, and the way a console line still goes."""
    return structlog.stdlib.BoundLogger(logging.getLogger(name), logs_module._through_stdlib_records(), {})


def _without_timestamp(line: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(k, v) for k, v in line.items() if k != "timestamp"]


def test_json_line_rendered_in_one_step_is_the_processor_chains_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys, their order and values as the processor chain and formatter render them: the leading
    keys, a caller's node kept and its reserved keys overridden, bound context, positional
    arguments, values JSON cannot encode, a stack and an exception; and no stdlib record made."""
    out = io.StringIO()
    configure_logging("info", "json", stream=out, node="node-7")
    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
        ("info", ("shared CPUs given",), {"event_name": "CreateContainer", "pod": "web", "count": 2}),
        ("warning", ("quota %s of %s", "a", 3), {"shown": _Shown(), "structured": _Structured()}),
        ("info", ("reserved",), {"msg": "x", "level": "y", "logger": "z", "timestamp": 1, "node": "mine"}),
        ("error", ("no event name",), {"event_name": None, "stack_info": True}),
        ("info", ("dict argument %(n)s",), {}),
        ("warn", ("warn is warning",), {}),
        ("critical", ("critical",), {}),
        ("fatal", ("fatal is critical",), {}),
        ("debug", ("below the level: no line",), {}),
    ]

    def log_all(logger: Any) -> None:
        for method, args, kwargs in calls:
            getattr(logger, method)(*args, **kwargs)
        logger.info("dict argument %(n)s", {"n": 5})
        logger.log(logging.WARNING, "by level number")
        try:
            raise ValueError("bad value")
        except ValueError:
            logger.bind(attempt=1).exception("it failed")

    log_all(_reference_logger("nri_plugin.test"))
    reference = json_lines(out.getvalue())
    out.truncate(0)
    out.seek(0)

    def no_record(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a stdlib record was made for a structlog line")

    with monkeypatch.context() as patched:
        patched.setattr(logging.Logger, "handle", no_record)
        log_all(log)
    fast = json_lines(out.getvalue())
    assert len(fast) == len(reference) == len(calls) - 1 + 3  # the debug call writes nothing
    for ours, theirs in zip(fast, reference, strict=True):
        ours_stack, theirs_stack = ours.pop("stack", None), theirs.pop("stack", None)
        assert (ours_stack is None) == (theirs_stack is None)
        assert _without_timestamp(ours) == _without_timestamp(theirs)
        assert ours["timestamp"].endswith("Z")
    assert fast[3]["level"] == "error"
    assert [line["level"] for line in fast[5:8]] == ["warning", "critical", "critical"]
    assert fast[-1]["exception"].endswith("ValueError: bad value")


@pytest.mark.parametrize(
    "time_ns",
    [
        0,
        1_700_000_000_000_000_000,
        1_700_000_000_123_456_789,
        1_700_000_000_000_001_000,
        1_999_999_999_999_999_999,
    ],
)
def test_json_timestamp_is_structlogs_iso_utc(time_ns: int) -> None:
    seconds, micro = divmod(time_ns // 1000, 1_000_000)
    expected = (
        datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
        .replace(microsecond=micro)
        .isoformat()
        .replace("+00:00", "Z")
    )
    assert logs_module._iso_utc(time_ns) == expected
    assert logs_module._iso_utc(time_ns) == expected  # the second's text cached


def test_capture_logs_sees_the_lines_of_loggers_cached_in_the_json_format() -> None:
    """A test's structlog.testing.capture_logs (the chain changed in place) takes the lines of
    loggers cached with the daemon's configuration; our chain back, they are JSON lines again."""
    out = io.StringIO()
    configure_logging("info", "json", stream=out, cache_loggers=True, node="node-7")
    cached = structlog.get_logger("nri_plugin.test.cached")
    cached.info("before")
    with structlog.testing.capture_logs() as logged:
        cached.warning("captured", why="a test")
    cached.info("after")
    assert logged == [{"event": "captured", "why": "a test", "log_level": "warning"}]
    assert [e["msg"] for e in json_lines(out.getvalue())] == ["before", "after"]


def test_json_lines_follow_logging_disable_and_a_disabled_logger() -> None:
    out = io.StringIO()
    configure_logging("info", "json", stream=out)
    logging.disable(logging.WARNING)
    try:
        log.warning("disabled")
        log.error("above what is disabled")
    finally:
        logging.disable(logging.NOTSET)
    stdlib = logging.getLogger("nri_plugin.test")
    stdlib.disabled = True
    try:
        log.error("its logger disabled")
    finally:
        stdlib.disabled = False
    log.info("enabled again")
    assert [e["msg"] for e in json_lines(out.getvalue())] == ["above what is disabled", "enabled again"]


def test_json_line_that_cannot_be_written_is_reported_not_raised(capsys: pytest.CaptureFixture[str]) -> None:
    class Unshowable:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    out = io.StringIO()
    configure_logging("info", "json", stream=out)
    log.info("bad field", value=Unshowable())  # no exception here
    log.info("next line")
    assert [e["msg"] for e in json_lines(out.getvalue())] == ["next line"]
    assert "--- Logging error ---" in capsys.readouterr().err


def test_console_lines_are_text() -> None:
    out = io.StringIO()
    assert configure_logging("warning", "console", stream=out) == "console"
    log.warning("cannot lower the pod quota", event_name="StopContainer", pod="app")
    log.info("not at warning")
    logging.getLogger("asyncio").error("loop trouble")
    ours, theirs = out.getvalue().splitlines()
    when, rest = ours.split(" ", 1)
    assert when.endswith("Z")  # an ISO timestamp
    assert rest.startswith("[warning  ] cannot lower the pod quota")
    assert rest.endswith("[nri_plugin.test] event=StopContainer pod=app")
    assert "\x1b[" not in ours  # no colours off a terminal
    assert theirs.split(" ", 1)[1].startswith("[error    ] loop trouble")


def test_console_escapes_control_and_format_characters_as_json_does() -> None:
    """A pod named with a newline or a right-to-left override cannot forge or disguise a console line;
    printable text, accents included, is left as it is."""
    out = io.StringIO()
    configure_logging("info", "console", stream=out)
    log.warning("request refused", pod="evil\u202etxt.exe", container="a\nb", namespace="café")
    [line] = out.getvalue().splitlines()
    assert "pod=evil\\u202etxt.exe" in line
    assert "container=a\\u000ab" in line
    assert "namespace=café" in line
    assert "\u202e" not in line


def test_auto_is_console_on_a_terminal_and_json_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_format("auto", FakeTerminal()) == "console"
    assert resolve_format("auto", io.StringIO()) == "json"
    assert resolve_format("json", FakeTerminal()) == "json"
    assert resolve_format("console", io.StringIO()) == "console"
    with pytest.raises(ValueError, match="unknown log format 'xml'"):
        resolve_format("xml")
    # A real terminal as stderr: a pseudo-terminal whose other end we read.
    leader, follower = os.openpty()
    with open(follower, "w", encoding="utf-8") as terminal, open(leader, "rb", buffering=0) as screen:
        monkeypatch.setattr("sys.stderr", terminal)
        monkeypatch.setenv("NO_COLOR", "1")
        assert configure_logging("info", "auto") == "console"
        log.info("hello terminal", pod="app")
        terminal.flush()
        shown = screen.read(4096).decode()
    assert "[info     ] hello terminal" in shown
    assert "pod=app" in shown
    assert not shown.startswith("{")
    # The same call with stderr a pipe-like stream: JSON.
    out = io.StringIO()
    monkeypatch.setattr("sys.stderr", out)
    assert configure_logging("info", "auto") == "json"
    log.info("hello pipe")
    [line] = json_lines(out.getvalue())
    assert line["msg"] == "hello pipe"


def test_unknown_level_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown log level 'loud': use debug, info, warning, error"):
        configure_logging("loud", "json")


def test_toggle_debug_for_both_kinds_of_logger() -> None:
    out = io.StringIO()
    configure_logging("warning", "json", stream=out)
    stdlib = logging.getLogger("nri_plugin.ttrpc.aio")
    log.debug("hidden 1")
    stdlib.debug("hidden 2")
    assert toggle_debug() == "debug"
    log.debug("shown 1")
    stdlib.debug("shown 2")
    assert toggle_debug() == "warning"
    log.debug("hidden 3")
    stdlib.debug("hidden 4")
    log.warning("still shown")
    assert [(e["level"], e["msg"]) for e in json_lines(out.getvalue())] == [
        ("info", "debug logging on; send SIGUSR1 again to turn it off"),
        ("debug", "shown 1"),
        ("debug", "shown 2"),
        ("info", "debug logging off; level back to warning"),
        ("warning", "still shown"),
    ]
    # Configured at debug, the toggle goes to info and back.
    configure_logging("debug", "json", stream=out)
    assert toggle_debug() == "info"
    assert toggle_debug() == "debug"


async def _level_becomes(level: int) -> None:
    """Until the loop has run the signal handler (the signal only wakes the loop up)."""
    for _ in range(int(GUARD / 0.005)):
        if logging.getLogger().level == level:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"the root logger's level is not {level} after {GUARD} s")


@pytest.mark.asyncio
async def test_sigusr1_toggles_debug_in_the_loop() -> None:
    out = io.StringIO()
    configure_logging("info", "json", stream=out)
    with debug_toggle_on_sigusr1(asyncio.get_running_loop()):
        log.debug("before")
        os.kill(os.getpid(), signal.SIGUSR1)
        await _level_becomes(logging.DEBUG)
        log.debug("during")
        os.kill(os.getpid(), signal.SIGUSR1)
        await _level_becomes(logging.INFO)
        log.debug("after")
    assert [e["msg"] for e in json_lines(out.getvalue())] == [
        "debug logging on; send SIGUSR1 again to turn it off",
        "during",
        "debug logging off; level back to info",
    ]


# -- the plugin's lines about containers --------------------------------------------------------------


@pytest.mark.asyncio
async def test_container_lines_carry_namespace_pod_container_and_event(tmp_path: Path) -> None:
    out = io.StringIO()
    configure_logging("debug", "json", stream=out)
    naming = Naming("containerd", "cgroupfs")
    tree = FakeCgroups(tmp_path / "cgroup")
    plugin, key = make_plugin(tmp_path / "state", tree.layout)
    pod = make_pod(naming, "1111-2222", name="packet-fwd")
    pod.namespace = "telco"
    tree.add_pod(pod, 2 * PERIOD)
    fwd = make_container(naming, pod, "c1", "fwd", annotations=marker(key))
    assert await plugin.create_container(pod, fwd) is not None
    plain = make_container(naming, pod, "c2", "sidecar", cpus="6")
    assert await plugin.create_container(pod, plain) is None
    requested = api.LinuxResources()
    requested.cpu.cpus = "4-5"
    await plugin.update_container(pod, fwd, requested)
    await plugin.stop_container(pod, fwd)
    running = make_container(naming, pod, "c3", "fwd", annotations=marker(key), state=api.CONTAINER_RUNNING)
    await plugin.synchronize([pod], [running])

    entries = json_lines(out.getvalue())
    # The decision trace's lines (each with a "step"; tests/test_decision_trace.py) aside:
    assert [(e["msg"], e["event"], e.get("container")) for e in entries if "step" not in e] == [
        ("shared CPUs given", "CreateContainer", "fwd"),
        ("no request for shared CPUs", "CreateContainer", "sidecar"),
        ("kept shared CPUs on update", "UpdateContainer", "fwd"),
        ("shared container stopped: its pod quota share is released", "StopContainer", "fwd"),
        ("bringing an existing container to the shared CPUs", "Synchronize", "fwd"),
        ("container must restart to see the current CPU sets in its environment", "Synchronize", "fwd"),
        ("pod quota brought to its target", "Synchronize", None),  # about the pod alone
    ]
    for entry in entries:
        assert (entry["namespace"], entry["pod"], entry["logger"]) == (
            "telco",
            "packet-fwd",
            "nri_plugin.mixedcpu.plugin",
        )
        assert "pod_namespace" not in entry


# -- the daemon -------------------------------------------------------------------------------------------


class Stderr:
    """The daemon's stderr, one JSON object per line, read as it comes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.entries: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self._changed = asyncio.Condition()
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        assert self.proc.stderr is not None
        async for line in self.proc.stderr:
            async with self._changed:
                self.raw.append(line.decode())
                self.entries.append(json.loads(line))
                self._changed.notify_all()

    def messages(self, level: str | None = None) -> list[str]:
        return [e["msg"] for e in self.entries if level is None or e["level"] == level]

    async def wait_for(self, message: str, nth: int = 1) -> dict[str, Any]:
        """The `nth` line with `message`, once it has come."""
        try:
            async with self._changed:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self.messages().count(message) >= nth), GUARD
                )
        except asyncio.TimeoutError:
            raise AssertionError(
                f"no line {nth} of {message!r} within {GUARD} s:\n{''.join(self.raw)}"
            ) from None
        return [e for e in self.entries if e["msg"] == message][nth - 1]

    async def close(self) -> None:
        await asyncio.wait_for(self._reader, GUARD)


@pytest.fixture
def device_plugins() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest_asyncio.fixture
async def daemon(tmp_path: Path, device_plugins: Path) -> AsyncIterator[tuple[RuntimeSimulator, Stderr]]:
    socket_path = tmp_path / "nri.sock"
    config = write_daemon_config(tmp_path, device_plugins)
    async with (
        RuntimeSimulator(socket_path) as sim,
        daemon_process("run", "--config", str(config), "--socket", str(socket_path)) as proc,
    ):
        stderr = Stderr(proc)
        await sim.wait_for_plugins(1, GUARD)
        yield sim, stderr
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), GUARD) == 0, "".join(stderr.raw)
        await stderr.close()


@pytest.mark.asyncio
async def test_daemon_logs_json_and_sigusr1_toggles_debug(
    daemon: tuple[RuntimeSimulator, Stderr],
) -> None:
    sim, stderr = daemon
    pod = api.PodSandbox(id="s1", uid="1234", name="web", namespace="shop")
    pod.linux.cgroup_parent = "/kubepods/pod1234"
    await sim.run_pod_sandbox(pod)

    async def create(cid: str) -> None:
        container = api.Container(id=cid, pod_sandbox_id="s1", name=f"app-{cid}")
        container.linux.resources.cpu.cpus = "2"
        await sim.create_container(container)

    await create("c1")
    stderr.proc.send_signal(signal.SIGUSR1)
    await stderr.wait_for("debug logging on; send SIGUSR1 again to turn it off")
    await create("c2")
    line = await stderr.wait_for("no request for shared CPUs")
    stderr.proc.send_signal(signal.SIGUSR1)
    await stderr.wait_for("debug logging off; level back to info")
    await create("c3")
    # Debug on once more: that line comes after anything c3's creation logged.
    stderr.proc.send_signal(signal.SIGUSR1)
    await stderr.wait_for("debug logging on; send SIGUSR1 again to turn it off", nth=2)
    assert {k: line[k] for k in ("level", "event", "namespace", "pod", "container")} == {
        "level": "debug",
        "event": "CreateContainer",
        "namespace": "shop",
        "pod": "web",
        "container": "app-c2",
    }
    assert [e["container"] for e in stderr.entries if e["msg"] == "no request for shared CPUs"] == ["app-c2"]
    assert "starting" in stderr.messages("info")  # every line so far parsed as JSON


def test_json_line_encoder_writes_what_json_dumps_writes() -> None:
    """The line's encoder writes what ``json.dumps`` with our fallback writes: escapes, non-finite
    floats, nesting, values JSON cannot show; and refuses a circular value as it does, line after
    line (no table of containers left over from a failure)."""
    values: dict[str, Any] = {
        "text": 'quote " newline \n tab \t rtl \u202e café',
        "numbers": [0, -1, 2**70, 1.5, float("nan"), float("inf"), float("-inf")],
        "nested": {"a": [None, True, False, {"b": ()}]},
        "shown": _Shown(),
        "structured": _Structured(),
    }
    assert logs_module._encode(values) == json.dumps(values, default=logs_module._json_fallback)
    circular: list[Any] = []
    circular.append(circular)
    for _ in range(2):
        with pytest.raises(ValueError, match="Circular reference"):
            logs_module._encode({"loop": circular})
    assert logs_module._encode({"after": [1]}) == '{"after": [1]}'
