"""NRI events: their numbers, the subscription mask, and what each runtime version accepts.

The numbers and mask layout are NRI's (event ``e`` is bit ``1 << (e - 1)``). A runtime refuses a
plugin whose mask has a bit it does not know, so the mask a plugin sends must be limited to what the
runtime's NRI version accepts; that version is given by ``ConfigureRequest.NRI_version`` from NRI
v0.12.0 on and must be inferred from the runtime's name and version before that.

What each event is to a plugin (its method, handler, request and response) is in
`nri_plugin.nri.routes`. Imports nothing beyond the standard library.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable


class Event(enum.IntEnum):
    RUN_POD_SANDBOX = 1
    STOP_POD_SANDBOX = 2
    REMOVE_POD_SANDBOX = 3
    CREATE_CONTAINER = 4
    POST_CREATE_CONTAINER = 5
    START_CONTAINER = 6
    POST_START_CONTAINER = 7
    UPDATE_CONTAINER = 8
    POST_UPDATE_CONTAINER = 9
    STOP_CONTAINER = 10
    REMOVE_CONTAINER = 11
    UPDATE_POD_SANDBOX = 12
    POST_UPDATE_POD_SANDBOX = 13
    VALIDATE_CONTAINER_ADJUSTMENT = 14

    @property
    def bit(self) -> int:
        return 1 << (self.value - 1)


def mask_of(events: Iterable[Event]) -> int:
    mask = 0
    for event in events:
        mask |= event.bit
    return mask


def events_in(mask: int) -> list[Event]:
    return [event for event in Event if mask & event.bit]


# What runtimes of each NRI generation accept (``ValidEvents``): events 1-11 up to NRI v0.9,
# 1-13 in the NRI snapshot CRI-O 1.33 ships, 1-14 from NRI v0.10.0 on.
VALID_EVENTS_V0_9 = (1 << 11) - 1
VALID_EVENTS_CRIO_1_33 = (1 << 13) - 1
VALID_EVENTS_V0_10 = (1 << 14) - 1

_VERSION = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(text: str) -> tuple[int, int, int] | None:
    """``"v2.3.4"`` → ``(2, 3, 4)``; ``None`` when the text does not start with a version."""
    match = _VERSION.match(text.strip())
    if match is None:
        return None
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def valid_events(*, nri_version: str, runtime_name: str, runtime_version: str) -> int:
    """The event mask the runtime will accept, from the most reliable facts it gave us.

    Unknown runtimes get the mask every NRI runtime accepts (events 1-11).
    """
    if nri_version:
        parsed = parse_version(nri_version)
        if parsed is not None:
            return VALID_EVENTS_V0_10 if parsed[:2] >= (0, 10) else VALID_EVENTS_V0_9
    version = parse_version(runtime_version)
    if version is None:
        return VALID_EVENTS_V0_9
    name = runtime_name.lower()
    if name == "containerd":
        return VALID_EVENTS_V0_10 if version[:2] >= (2, 2) else VALID_EVENTS_V0_9
    if name in ("cri-o", "crio"):
        if version[:2] >= (1, 34):
            return VALID_EVENTS_V0_10
        if version[:2] == (1, 33):
            return VALID_EVENTS_CRIO_1_33
    return VALID_EVENTS_V0_9
