"""Which open connection a newcomer makes room by closing: a server's fairness bookkeeping.

Pure: the server says the time and the loop's turn, when a connection's first bytes arrive and
while it is answered, and closes what `ConnectionTable.admit` hands back. Shared by the probes and
metrics server (`nri_plugin.daemon.probes`) and the status socket (`nri_plugin.daemon.status`), so
that neither an idle crowd nor a churn of connections denies either to the client it exists for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

__all__ = ["EVICTION_REASONS", "ConnectionTable", "Eviction"]

# Why a connection was evicted: its peer held `per_peer` already, or the server `total`, or
# `hard_total` with nothing else to evict (then it may be the newcomer itself).
EVICTION_REASONS: Final = ("peer_limit", "total_limit", "hard_limit")
# Turns of the loop a connection is kept before it may be evicted: a client that sends its request
# with the connection (a prober, `status`) is read within two.
FAIR_TURNS: Final = 3

_Item = TypeVar("_Item")


@dataclass(frozen=True)
class Eviction(Generic[_Item]):
    """The connection a newcomer makes room by closing: whose, which, and why (`EVICTION_REASONS`)."""

    peer: str
    item: _Item
    reason: str


@dataclass
class _Entry:
    """One open connection: whose, when it was taken (loop time, turn), and how far it got."""

    peer: str
    since: float
    turn: int
    state: str = "quiet"  # nothing received yet; "heard": part of a request; "answering"


class ConnectionTable(Generic[_Item]):
    """The open connections, oldest first, and which one a newcomer evicts.

    Pure bookkeeping: the server tells the time and the loop's turn, says when a connection's first
    bytes arrive (`heard`) and while it is being answered (`answering`), and closes what `admit`
    hands back. A newcomer is always taken; what makes room is, in this order:

    * a peer (source address) at `per_peer` gives up its own oldest connection;
    * at `total`, the oldest connection that has said nothing yet, else the oldest still sending its
      request (slow-loris), never one being answered.

    Either only among connections that have had their chance to be read: taken at least
    `fair_turns` turns of the loop and `fair_time` seconds ago. A prober sends its request with the
    connection, it is heard and read within a turn or two, and from then on it is the last to go:
    so a churn of idle connections, from as many addresses as it likes, never evicts kubelet's
    probe before it was read. While no connection has had its chance (they come faster than the
    loop reads), newcomers are taken beyond `total`, up to `hard_total` (file descriptors are
    finite); there, the same order but among any not taken within the current turn; when all were,
    the newcomer itself is closed. The last two count as ``hard_limit``.
    """

    def __init__(
        self,
        *,
        total: int,
        per_peer: int,
        hard_total: int | None = None,
        fair_turns: int = 0,
        fair_time: float = 0.0,
        heard_time: float = 0.0,
    ) -> None:
        hard_total = 4 * total if hard_total is None else hard_total
        if total < 1 or per_peer < 1 or hard_total < total:
            raise ValueError("connection limits must be at least 1, and the hard one at least the total")
        self.total = total
        self.per_peer = per_peer
        self.hard_total = hard_total
        self.fair_turns = fair_turns
        self.fair_time = fair_time
        self.heard_time = heard_time
        self.evicted = 0
        self._entries: dict[_Item, _Entry] = {}  # every open connection, oldest first
        self._pools: dict[str, dict[_Item, None]] = {"quiet": {}, "heard": {}, "answering": {}}
        self._peers: dict[str, dict[_Item, None]] = {}  # per peer, oldest first

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[_Item]:
        yield from list(self._entries)

    def held_by(self, peer: str) -> int:
        return len(self._peers.get(peer, ()))

    def admit(
        self, peer: str, item: _Item, *, now: float = 0.0, turn: int = 0, heard: bool = False
    ) -> Eviction[_Item] | None:
        """Count `item` as open from `peer`, taken at loop time `now` in the loop's `turn` (`heard`:
        bytes of it arrived already); the connection it evicts, already forgotten here and for the
        caller to close, if the limits call for one (`item` itself when it is refused: then it is not
        counted)."""
        eviction = self._victim(peer, item, now, turn)
        if eviction is not None:
            self.evicted += 1
            if eviction.item is item:
                return eviction
            self.discard(eviction.item)
        self._entries[item] = _Entry(peer, now, turn)
        self._peers.setdefault(peer, {})[item] = None
        self._pools["quiet"][item] = None
        if heard:
            self.heard(item)
        return eviction

    def taken_before(self, before: float) -> list[_Item]:
        """The connections taken before loop time `before`, oldest first."""
        found = []
        for item, entry in self._entries.items():
            if entry.since >= before:
                break
            found.append(item)
        return found

    def heard(self, item: _Item) -> None:
        """The first bytes of `item`'s request arrived."""
        self._move(item, "quiet", "heard")

    def answering(self, item: _Item, busy: bool) -> None:
        """Whether `item`'s request is being answered (read, its answer not yet sent): it is not
        evicted meanwhile, which would throw its answer away."""
        if busy:
            self._move(item, "heard", "answering") or self._move(item, "quiet", "answering")
        else:
            self._move(item, "answering", "heard")

    def discard(self, item: _Item) -> None:
        """Forget a closed connection (nothing if it was evicted already)."""
        entry = self._entries.pop(item, None)
        if entry is None:
            return
        self._pools[entry.state].pop(item, None)
        items = self._peers[entry.peer]
        del items[item]
        if not items:
            del self._peers[entry.peer]

    def _move(self, item: _Item, old: str, new: str) -> bool:
        entry = self._entries.get(item)
        if entry is None or entry.state != old:
            return False
        del self._pools[old][item]
        self._pools[new][item] = None
        entry.state = new
        return True

    def _victim(self, peer: str, item: _Item, now: float, turn: int) -> Eviction[_Item] | None:
        def fair(entry: _Entry) -> bool:
            if turn - entry.turn < self.fair_turns:
                return False
            return now - entry.since >= (self.fair_time if entry.state == "quiet" else self.heard_time)

        own = self._peers.get(peer)
        if own is not None and len(own) >= self.per_peer:
            found = next((mine for mine in own if self._entries[mine].state != "answering"), None)
            if found is not None and fair(self._entries[found]):
                return Eviction(peer, found, "peer_limit")
        if len(self._entries) < self.total:
            return None
        found = self._oldest(fair, fair)
        if found is not None:
            return Eviction(self._entries[found].peer, found, "total_limit")
        if len(self._entries) < self.hard_total:
            return None
        found = self._oldest(lambda entry: entry.turn < turn, fair)
        if found is not None:
            return Eviction(self._entries[found].peer, found, "hard_limit")
        return Eviction(peer, item, "hard_limit")  # none had its chance: the newcomer goes

    def _oldest(self, quiet: Callable[[_Entry], bool], heard: Callable[[_Entry], bool]) -> _Item | None:
        """The oldest quiet connection if `quiet` says it may go, else the oldest heard one if
        `heard` says so. (The first of a pool is its oldest: a younger one may not go either.)"""
        for pool, eligible in ((self._pools["quiet"], quiet), (self._pools["heard"], heard)):
            for item in pool:
                if eligible(self._entries[item]):
                    return item
                break
        return None
