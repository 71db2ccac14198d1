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

In the JSON format a structlog line (all of ours) does not go through structlog's processors and a
stdlib record: `_JsonLineLogger` renders it in one step, one JSON encoder call over the line's
fields in order, and hands the text to the handler to write. The same line, some 5 times cheaper
(about 45 us a line the long way): the plugin writes one per container given shared CPUs.
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
from json.encoder import c_make_encoder, encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any, ClassVar, Final, TextIO

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

    def write_json(
        self, logger_name: str, method_name: str, event: str | None, fields: dict[str, Any]
    ) -> None:
        """Render a structlog call's line (`_json_line`) and write it as `emit` writes a record's:
        under the handler's lock (grpc's threads log through it too), flushed, a failure (a value
        JSON cannot show, a closed stream) reported the stdlib's way, not raised at the caller."""
        with self.lock:  # type: ignore[union-attr]  # (what acquire and release take, straight)
            try:
                line = _json_line(logger_name, method_name, event, fields)
                stream = self.stream = self.target if self.target is not None else sys.stderr
                stream.write(line + self.terminator)
                stream.flush()
            except RecursionError:
                raise
            except Exception:  # as logging.StreamHandler.emit
                self.handleError(logging.makeLogRecord({"msg": event, "name": logger_name}))


class _Settings:
    """What `configure_logging` set last: the level `toggle_debug` returns to, our handler and the
    node every line names."""

    base_level: int = logging.INFO
    handler: _Handler | None = None
    node: str | None = None
    # The structlog processors it configured (a list structlog keeps and bound loggers share).
    chain: ClassVar[list[structlog.types.Processor]] = []


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


def _c_encode(line: dict[str, Any]) -> str:
    """`line` as ``json.dumps(line, default=_json_fallback)`` writes it, by json's C encoder made
    here (with a fresh table of the containers under way, for its check of circular values), not
    through `json.JSONEncoder.encode`'s Python layers (some 90 bytecodes a line)."""
    # markers, default, encoder, indent, key and item separators, sort_keys, skipkeys, allow_nan
    encoder = c_make_encoder(
        {}, _json_fallback, encode_basestring_ascii, None, ": ", ", ", False, False, True
    )
    return "".join(encoder(line, 0))


# Without json's C accelerator (not CPython), the encoder's own way.
_encode: Final = _c_encode if c_make_encoder is not None else json.JSONEncoder(default=_json_fallback).encode
# A logging method's level and the name a line shows for it, as structlog's stdlib logger has them
# (``exception`` logs at error, ``warn`` is ``warning``).
_METHOD_LEVELS: Final = {
    "critical": (logging.CRITICAL, "critical"),
    "exception": (logging.ERROR, "error"),
    "error": (logging.ERROR, "error"),
    "warn": (logging.WARNING, "warning"),
    "warning": (logging.WARNING, "warning"),
    "info": (logging.INFO, "info"),
    "debug": (logging.DEBUG, "debug"),
}
# The last processor of the chain configure_logging sets: the line goes on to our formatter.
_TO_FORMATTER: Final = structlog.stdlib.ProcessorFormatter.wrap_for_formatter
_WITH_ARGUMENTS: Final = structlog.stdlib.PositionalArgumentsFormatter()
# The caller's frame, not this module's, is where a line's stack starts.
_WITH_STACK: Final = structlog.processors.StackInfoRenderer(additional_ignores=[__name__])


def _json_line(
    logger_name: str, method_name: str, event: str | None, fields: MutableMapping[str, Any]
) -> str:
    """The JSON line the processor chain would render for a structlog call: the leading keys in
    their order (`_LEADING_KEYS`; the caller's own ``timestamp``, ``level``, ``logger`` or ``msg``
    give way, its ``node`` does not), then the caller's fields, then a stack or exception asked
    for with ``stack_info`` or ``exc_info``."""
    if "stack_info" in fields:
        fields = _WITH_STACK(None, method_name, fields)
    if "exc_info" in fields:
        fields = structlog.processors.format_exc_info(None, method_name, fields)
    line: dict[str, Any] = {"timestamp": _iso_utc(time.time_ns()), "level": _METHOD_LEVELS[method_name][1]}
    if NODE_KEY in fields:
        line[NODE_KEY] = fields[NODE_KEY]
    elif _Settings.node is not None:
        line[NODE_KEY] = _Settings.node
    line["logger"] = logger_name
    line[MESSAGE_KEY] = event
    named = fields.pop(EVENT_NAME, None)
    if named is not None:
        line["event"] = named
    # The leading keys first, in their order, then the caller's others in theirs; a leading key's
    # value is ours (merged last): one merge in C, not a loop over the fields.
    return _encode({**line, **fields, **line})


class _JsonLineLogger(structlog.stdlib.BoundLogger):
    """structlog's stdlib logger whose lines, in the JSON format, skip its processor chain and the
    stdlib record: filtered as the record would have been (the logger's level, live), rendered by
    `_json_line` and written by our handler (`_Handler.write_json`). Everything else (bind,
    is_enabled_for ...) is structlog's, and so is a line while another chain is configured in
    place of ours (a test's ``structlog.testing.capture_logs``)."""

    def _proxy_to_logger(
        self, method_name: str, event: str | None = None, *event_args: Any, **event_kw: Any
    ) -> Any:
        handler, chain = _Settings.handler, _Settings.chain
        if (
            handler is None
            or self._processors is not chain
            or chain[-1] is not _TO_FORMATTER
            or method_name not in _METHOD_LEVELS
        ):
            # Not the chain configure_logging set, or changed in place (structlog.testing.capture_logs
            # does): structlog's way.
            return super()._proxy_to_logger(method_name, event, *event_args, **event_kw)
        logger = self._logger
        # The stdlib logger's own test, as its record would have passed: its level (live), the
        # logger disabled, logging.disable.
        if not logger.isEnabledFor(_METHOD_LEVELS[method_name][0]):
            return None
        fields = {**self._context, **event_kw} if self._context else event_kw
        if event_args:
            formatted = {"event": event, "positional_args": event_args}
            event = _WITH_ARGUMENTS(None, method_name, formatted)["event"]
        handler.write_json(logger.name, method_name, event, fields)
        return None


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
    timestamper = structlog.processors.TimeStamper(fmt="iso")
    handler = _Handler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=_renderer_chain(rendered, colors, node),
            # What a stdlib record (grpc, asyncio, our ttrpc and mux modules) gets before rendering.
            foreign_pre_chain=[
                structlog.stdlib.add_logger_name,
                structlog.stdlib.add_log_level,
                timestamper,
            ],
        )
    )
    root = logging.getLogger()
    if _Settings.handler is not None:
        root.removeHandler(_Settings.handler)
    root.addHandler(handler)
    root.setLevel(threshold)
    _Settings.handler = handler
    _Settings.base_level = threshold
    _Settings.node = node
    _Settings.chain = [
        # The root logger's level decides, read at each call: toggle_debug takes effect at once.
        structlog.stdlib.filter_by_level,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.add_log_level,
        structlog.stdlib.PositionalArgumentsFormatter(),
        timestamper,
        structlog.processors.StackInfoRenderer(),
        _TO_FORMATTER,
    ]
    structlog.configure(
        processors=_Settings.chain,
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=_JsonLineLogger if rendered == "json" else structlog.stdlib.BoundLogger,
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
