"""Unit tests of ``ConnectionGuard``'s choice of which connection to close at the cap (one layer: the protocol
objects are stand-ins that record how they were closed; the end-to-end behaviour is in ``test_connections.py``)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.connections import FRESH_GRACE_S, ConnectionGuard


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Connection:
    """What the guard calls on a connection."""

    def __init__(self, name: str) -> None:
        self.name, self.closed = name, ""

    def evict(self) -> None:
        self.closed = "evicted"

    def evict_mid_body(self) -> None:
        self.closed = "evicted_mid_body"

    def __repr__(self) -> str:
        return self.name


@pytest.fixture
def clock() -> Clock:
    return Clock()


def guard_of(cap: int, clock: Clock) -> ConnectionGuard:
    return ConnectionGuard(cap, header_timeout_s=10, body_timeout_s=60, clock=clock)


def admit(guard: ConnectionGuard, name: str) -> Any:
    connection = Connection(name)
    assert guard.admit(connection)  # type: ignore[arg-type]
    return connection


def receiving(guard: ConnectionGuard, connection: Any) -> None:
    guard.spoke(connection)
    guard.receiving(connection)


def test_a_burst_of_new_connections_closes_stalled_bodies_not_each_other(clock: Clock) -> None:
    """At the cap with bodies stalled, new callers arrive together (accepted before any of their bytes is read):
    each must close a stalled body, not the new connection accepted just before it."""
    guard = guard_of(4, clock)
    stalled = [admit(guard, f"stalled{i}") for i in range(4)]
    for connection in stalled:
        receiving(guard, connection)
    clock.now += 5
    burst = [admit(guard, f"new{i}") for i in range(4)]
    assert [c.closed for c in stalled] == ["evicted_mid_body"] * 4
    assert not any(c.closed for c in burst)
    assert guard.closed["evicted_mid_body"] == 4 and guard.closed["evicted"] == 0


def test_a_silent_connection_past_its_grace_goes_before_a_stalled_body(clock: Clock) -> None:
    guard = guard_of(2, clock)
    silent = admit(guard, "silent")
    stalled = admit(guard, "stalled")
    receiving(guard, stalled)
    clock.now += FRESH_GRACE_S
    admit(guard, "new")
    assert silent.closed == "evicted" and not stalled.closed


def test_the_longest_waiting_of_idle_and_silent_goes_first(clock: Clock) -> None:
    guard = guard_of(2, clock)
    kept = admit(guard, "kept")  # served a request, now kept alive between requests
    receiving(guard, kept)
    guard.busy(kept)
    guard.idle(kept)
    clock.now += 1
    silent = admit(guard, "silent")
    clock.now += FRESH_GRACE_S
    admit(guard, "new")
    assert kept.closed == "evicted" and not silent.closed
    admit(guard, "next")
    assert silent.closed == "evicted"


def test_a_partial_head_is_idle_at_once_and_new_connections_go_last(clock: Clock) -> None:
    """A connection that sent part of a head (a slow or hostile one) is idle from its first byte; with only new
    connections and whole requests held, the oldest new one makes room, and with only whole requests the new
    connection is refused."""
    guard = guard_of(3, clock)
    partial = admit(guard, "partial")
    guard.spoke(partial)
    fresh = admit(guard, "fresh")
    busy = admit(guard, "busy")
    receiving(guard, busy)
    guard.busy(busy)
    new = admit(guard, "new")
    assert partial.closed == "evicted" and not fresh.closed
    last = admit(guard, "last")
    assert fresh.closed == "evicted" and not last.closed and not new.closed
    for connection in (new, last):
        receiving(guard, connection)
        guard.busy(connection)
    assert not guard.admit(Connection("refused"))  # type: ignore[arg-type]
    assert guard.closed == guard.closed | {"evicted": 2, "evicted_mid_body": 0, "refused": 1}
    assert guard.open == 3


def test_a_closed_connection_leaves_every_state(clock: Clock) -> None:
    guard = guard_of(8, clock)
    connections = [admit(guard, f"c{i}") for i in range(4)]
    guard.spoke(connections[1])
    receiving(guard, connections[2])
    receiving(guard, connections[3])
    guard.busy(connections[3])
    assert guard.open == 4
    for connection in connections:
        guard.forget(connection)
    assert guard.open == 0
