"""The daemon's log lines: structlog and stdlib logging (grpc, asyncio) through one handler on stderr.

Formats:

* ``json``: one JSON object per line, for log collectors;
* ``console``: aligned text for a person at a terminal (coloured there, unless ``NO_COLOR`` is set);
* ``auto`` (the default): ``console`` when stderr is a terminal, ``json`` when it is not (a pod, a
  systemd unit, a pipe).

Both kinds of logger pass through the same handler and the same renderer, so a grpc warning is a
JSON line like ours. The message is under ``msg``. A line about an NRI or kubelet request names the
request under ``event`` (``CreateContainer``, ``Synchronize``, ``Allocate`` ...), and a line about a
container also carries ``namespace``, ``pod`` and ``container``. structlog keeps its ``event``
argument for the message, so callers pass the request's name as ``event_name=`` (`EVENT_NAME`) and
the renderer moves it to ``event``.

One threshold, the root logger's level, filters both kinds of logger, so it can change at run time:
`toggle_debug` (SIGUSR1 in the daemon, see `debug_toggle_on_sigusr1`) switches debug on and back.

Given a node name (the daemon takes NODE_NAME from its environment; the manifests set it from the
pod's ``spec.nodeName``), every line carries it as ``node``: ``kubectl logs`` of a DaemonSet's pods
says which node a line is from.

In the JSON format a structlog line does not go through a stdlib record: the last processor of its
chain (`_json_fields`) orders the line's fields, and the logger structlog hands them to
(`_LineWriter`) renders them with one JSON encoder and writes the text through our handler. The
same line some 5 times cheaper than a stdlib record and `ProcessorFormatter` (about 45 us a line):
the plugin writes one per container given shared CPUs. Only structlog's public interface is used
(a processor chain, a logger factory, `structlog.stdlib.BoundLogger`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator, MutableMapping
from typing import Any, Final, TextIO

import structlog

__all__ = [
    "EVENT_NAME",
    "FORMATS",
    "LEVELS",
    "configure_logging",
    "debug_toggle_on_sigusr1",
    "resolve_format",
    "toggle_debug",
]

LEVELS: Final = ("debug", "info", "warning", "error")
FORMATS: Final = ("auto", "console", "json")
# The keyword a caller names its NRI or kubelet request with; rendered as "event".
EVENT_NAME: Final = "event_name"
MESSAGE_KEY: Final = "msg"
NODE_KEY: Final = "node"
# JSON keys put first, in this order, so a line reads left to right: when, how bad, where, who, what.
_LEADING_KEYS: Final = ("timestamp", "level", NODE_KEY, "logger", MESSAGE_KEY, "event")

log = structlog.get_logger("nri_plugin.daemon.logs")


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to `target`, or, when that is None, to whatever ``sys.stderr`` is at each record (so
    whoever replaces sys.stderr later, a test's capture for one, is honoured)."""

    def __init__(self, target: TextIO | None) -> None:
        super().__init__(target if target is not None else sys.stderr)
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        # Called with the handler's lock held.
        self.stream = self.target if self.target is not None else sys.stderr
        super().emit(record)

    def write_json(self, logger_name: str, line: dict[str, Any]) -> None:
        """Write a structlog call's line (`_json_fields`) as one JSON object, as `emit` writes a
        record's: under the handler's lock (grpc's threads log through it too), flushed, a failure
        (a value JSON cannot show, a closed stream) reported the stdlib's way, not raised at the
        caller."""
        with self.lock:  # type: ignore[union-attr]  # (what acquire and release take)
            try:
                text = _encode(line)
                self.stream = self.target if self.target is not None else sys.stderr
                self.stream.write(text + self.terminator)
                self.stream.flush()
            except RecursionError:
                raise
            except Exception:  # as logging.StreamHandler.emit
                self.handleError(logging.makeLogRecord({"msg": line.get(MESSAGE_KEY), "name": logger_name}))


class _Settings:
    """What `configure_logging` set last: the level `toggle_debug` returns to and our handler."""

    base_level: int = logging.INFO
    handler: _Handler | None = None


class _Stamp:
    """The last second `_iso_utc` formatted, and its text: (second, "YYYY-MM-DDTHH:MM:SS"), one
    attribute so that a thread reads a matching pair."""

    second_text: tuple[int, str] = (-1, "")


def _iso_utc(time_ns: int) -> str:
    """`time_ns` (ns since the epoch) as structlog's ``TimeStamper(fmt="iso")`` writes it, in UTC
    with microseconds (none when they are 0, as ``datetime.isoformat``) and a ``Z``; the date and
    time of day formatted once a second, not at each line."""
    second, micro = divmod(time_ns // 1000, 1_000_000)
    cached, text = _Stamp.second_text
    if cached != second:
        text = datetime.datetime.fromtimestamp(second, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
        _Stamp.second_text = (second, text)
    return f"{text}.{micro:06d}Z" if micro else f"{text}Z"


def _json_fallback(value: object) -> object:
    """What JSON cannot encode, as structlog's JSONRenderer shows it: its ``__structlog__()``, or
    its repr."""
    shown = getattr(value, "__structlog__", None)
    return shown() if callable(shown) else repr(value)


# A line as ``json.dumps(line, default=_json_fallback)`` writes it (one encoder for every line: it
# keeps no state between calls).
_encode: Final = json.JSONEncoder(default=_json_fallback).encode
# A logging method's level and the name a line shows for it, as structlog's stdlib logger has them
# (``exception`` logs at error; ``warn``, ``fatal`` and ``log`` come as the method they stand for).
_METHOD_LEVELS: Final = {
    "critical": (logging.CRITICAL, "critical"),
    "exception": (logging.ERROR, "error"),
    "error": (logging.ERROR, "error"),
    "warning": (logging.WARNING, "warning"),
    "info": (logging.INFO, "info"),
    "debug": (logging.DEBUG, "debug"),
}
_WITH_ARGUMENTS: Final = structlog.stdlib.PositionalArgumentsFormatter()
_WITH_STACK: Final = structlog.processors.StackInfoRenderer()


class _LineWriter:
    """The logger a structlog logger wraps in the JSON format: the stdlib logger of the same name
    says which levels are on (its level, live; the logger disabled; ``logging.disable``), and each
    logging method writes the fields `_json_fields` made as a JSON line through our handler, with
    no stdlib record."""

    def __init__(self, logger: logging.Logger, handler: _Handler) -> None:
        self.logger = logger
        self.name = logger.name
        self._handler = handler

    def isEnabledFor(self, level: int) -> bool:
        return self.logger.isEnabledFor(level)

    def getEffectiveLevel(self) -> int:
        return self.logger.getEffectiveLevel()

    def write(self, line: dict[str, Any]) -> None:
        self._handler.write_json(self.name, line)

    debug = info = warning = error = critical = exception = write


class _LineWriterFactory:
    """structlog's logger factory for the JSON format: a `_LineWriter` over the stdlib logger that
    structlog's own factory would give."""

    def __init__(self, handler: _Handler) -> None:
        self._handler = handler
        self._loggers = structlog.stdlib.LoggerFactory(ignore_frame_names=[__name__])

    def __call__(self, *args: Any) -> _LineWriter:
        return _LineWriter(self._loggers(*args), self._handler)


def _at_enabled_level(
    logger: _LineWriter, method_name: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """Drop a line its stdlib logger would not take (structlog's ``filter_by_level`` does not see
    ``logging.disable``)."""
    if logger.isEnabledFor(_METHOD_LEVELS[method_name][0]):
        return event_dict
    raise structlog.DropEvent


def _json_fields(node: str | None) -> structlog.types.Processor:
    """The last processor of the JSON chain: a line's fields as the stdlib chain and formatter would
    render them, handed to `_LineWriter` as one dict: the leading keys in their order
    (`_LEADING_KEYS`; the caller's own ``timestamp``, ``level``, ``logger`` or ``msg`` give way, its
    ``node`` does not), then the caller's fields, then a stack or exception asked for with
    ``stack_info`` or ``exc_info``."""

    def json_fields(
        logger: _LineWriter, method_name: str, fields: MutableMapping[str, Any]
    ) -> tuple[tuple[dict[str, Any]], dict[str, Any]]:
        if "positional_args" in fields:
            fields = _WITH_ARGUMENTS(logger, method_name, fields)
        if "stack_info" in fields:
            fields = _WITH_STACK(logger, method_name, fields)
        if "exc_info" in fields:
            fields = structlog.processors.format_exc_info(logger, method_name, fields)
        event = fields.pop("event", None)
        line: dict[str, Any] = {
            "timestamp": _iso_utc(time.time_ns()),
            "level": _METHOD_LEVELS[method_name][1],
        }
        if NODE_KEY in fields:
            line[NODE_KEY] = fields[NODE_KEY]
        elif node is not None:
            line[NODE_KEY] = node
        line["logger"] = logger.name
        line[MESSAGE_KEY] = event
        named = fields.pop(EVENT_NAME, None)
        if named is not None:
            line["event"] = named
        # The leading keys first, in their order, then the caller's others in theirs; a leading
        # key's value is ours (merged last).
        return ({**line, **fields, **line},), {}

    return json_fields


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):  # a closed or detached stream
        return False


def resolve_format(log_format: str, stream: TextIO | None = None) -> str:
    """``console`` or ``json``: `log_format` itself, or for ``auto`` what suits `stream` (stderr
    when None): console on a terminal, JSON anywhere else."""
    if log_format not in FORMATS:
        raise ValueError(f"unknown log format {log_format!r}: use {', '.join(FORMATS)}")
    if log_format != "auto":
        return log_format
    return "console" if _is_terminal(stream if stream is not None else sys.stderr) else "json"


def _level_number(level: str) -> int:
    if level not in LEVELS:
        raise ValueError(f"unknown log level {level!r}: use {', '.join(LEVELS)}")
    number = logging.getLevelName(level.upper())
    assert isinstance(number, int)
    return number


def _leading_keys_first(
    _logger: object, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    ordered = {key: event_dict.pop(key) for key in _LEADING_KEYS if key in event_dict}
    ordered.update(event_dict)
    return ordered


def _naming_node(node: str) -> structlog.types.Processor:
    def add_node(
        _logger: object, _method: str, event_dict: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        event_dict.setdefault(NODE_KEY, node)
        return event_dict

    return add_node


def _renderer_chain(rendered: str, colors: bool, node: str | None) -> list[structlog.types.Processor]:
    common: list[structlog.types.Processor] = [
        structlog.stdlib.ProcessorFormatter.remove_processors_meta,
        structlog.processors.EventRenamer(MESSAGE_KEY, replace_by=EVENT_NAME),
    ]
    if node is not None:
        common.append(_naming_node(node))
    if rendered == "json":
        return [
            *common,
            structlog.processors.format_exc_info,
            _leading_keys_first,
            structlog.processors.JSONRenderer(),
        ]
    return [
        *common,
        _escape_unprintable,
        structlog.dev.ConsoleRenderer(colors=colors, event_key=MESSAGE_KEY),
    ]


def _escaped(text: str) -> str:
    return "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in text)


def _escape_unprintable(
    _logger: object, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """Console text shows control and format characters escaped, as JSON does: a pod name holding a
    newline or a right-to-left override cannot forge or disguise a log line."""
    for key, value in event_dict.items():
        if isinstance(value, str) and not value.isprintable():
            event_dict[key] = _escaped(value)
    return event_dict


def _through_stdlib_records() -> list[structlog.types.Processor]:
    """structlog's processor chain onto stdlib records, which our handler's `ProcessorFormatter`
    renders: the console format's, and the long way of a JSON line."""
    return [
        # The root logger's level decides, read at each call: toggle_debug takes effect at once.
        structlog.stdlib.filter_by_level,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.add_log_level,
        structlog.stdlib.PositionalArgumentsFormatter(),
        structlog.processors.TimeStamper(fmt="iso"),
        structlog.processors.StackInfoRenderer(),
        structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
    ]


def configure_logging(
    level: str,
    log_format: str = "auto",
    *,
    stream: TextIO | None = None,
    cache_loggers: bool = False,
    node: str | None = None,
) -> str:
    """Send every log line, structlog's and stdlib's, to `stream` (stderr when None) at `level` and
    above, in `log_format` (see the module docstring), naming `node` when given. Returns the format
    used, console or json.

    May be called again: the new settings replace the old ones, except for loggers already cached:
    with `cache_loggers` each structlog logger keeps the settings of its first use (it is not bound
    anew at every call, some 5 us each), so only a process that configures logging once for good,
    the daemon, asks for it. The level stays live either way (`toggle_debug`): it is read from the
    root logger at each call. Raises ValueError for an unknown level or format.
    """
    threshold = _level_number(level)
    rendered = resolve_format(log_format, stream)
    colors = (
        rendered == "console"
        and _is_terminal(stream if stream is not None else sys.stderr)
        and "NO_COLOR" not in os.environ
    )
    handler = _Handler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=_renderer_chain(rendered, colors, node),
            # What a stdlib record (grpc, asyncio, our ttrpc and mux modules) gets before rendering.
            foreign_pre_chain=[
                structlog.stdlib.add_logger_name,
                structlog.stdlib.add_log_level,
                structlog.processors.TimeStamper(fmt="iso"),
            ],
        )
    )
    root = logging.getLogger()
    if _Settings.handler is not None:
        root.removeHandler(_Settings.handler)
    root.addHandler(handler)
    root.setLevel(threshold)
    # The DRA front door's API client logs every HTTP request at info; its failures are ours to say.
    logging.getLogger("httpx2").setLevel(max(threshold, logging.WARNING))
    _Settings.handler = handler
    _Settings.base_level = threshold
    if rendered == "json":
        processors: list[structlog.types.Processor] = [_at_enabled_level, _json_fields(node)]
        loggers: Any = _LineWriterFactory(handler)
    else:
        processors, loggers = _through_stdlib_records(), structlog.stdlib.LoggerFactory()
    structlog.configure(
        processors=processors,
        logger_factory=loggers,
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=cache_loggers,
    )
    return rendered


def toggle_debug() -> str:
    """Debug on if it is off, else back to the configured level (info if that was debug). Logs the
    change while debug is still on, so the line shows at any level. Returns the new level's name."""
    root = logging.getLogger()
    if root.getEffectiveLevel() > logging.DEBUG:
        root.setLevel(logging.DEBUG)
        log.info("debug logging on; send SIGUSR1 again to turn it off")
        return "debug"
    back = _Settings.base_level if _Settings.base_level > logging.DEBUG else logging.INFO
    name = logging.getLevelName(back).lower()
    log.info(f"debug logging off; level back to {name}")
    root.setLevel(back)
    return name


@contextlib.contextmanager
def debug_toggle_on_sigusr1(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """While the body runs, SIGUSR1 toggles debug logging (see `toggle_debug`)."""
    loop.add_signal_handler(signal.SIGUSR1, toggle_debug)
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGUSR1)
