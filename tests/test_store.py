"""The in-memory session store: exclusivity, limits and idle expiry (unit tests of one layer)."""

from __future__ import annotations

import pytest

from gateway.errors import SessionBusy, SessionExists, SessionNotFound, TooManySessions
from gateway.sample import SessionSample
from gateway.store import SessionStore


def sample() -> SessionSample:
    return SessionSample.from_prompt([1, 2, 3])


def test_ids_are_unique_and_lookups_fail_clearly() -> None:
    store = SessionStore(max_sessions=10)
    session = store.create(sample(), session_id="a")
    assert store.get("a") is session
    with pytest.raises(SessionExists):
        store.create(sample(), session_id="a")
    with pytest.raises(SessionNotFound):
        store.get("b")
    generated = store.create(sample())
    assert len(generated.session_id) == 32 and len(store) == 2


def test_max_sessions_is_a_429() -> None:
    store = SessionStore(max_sessions=1)
    store.create(sample())
    with pytest.raises(TooManySessions) as caught:
        store.create(sample())
    assert caught.value.status_code == 429


async def test_exclusive_holds_the_session_and_releases_it_on_error() -> None:
    store = SessionStore(max_sessions=10)
    store.create(sample(), session_id="a")
    with pytest.raises(RuntimeError):
        async with store.exclusive("a") as session:
            assert session.busy
            with pytest.raises(SessionBusy):
                store.acquire("a")
            with pytest.raises(SessionBusy):
                store.delete("a")
            raise RuntimeError("the turn failed")
    assert not store.get("a").busy
    store.delete("a")
    assert len(store) == 0


def test_idle_sessions_expire_but_busy_ones_stay() -> None:
    store = SessionStore(max_sessions=10)
    idle, busy, fresh = (store.create(sample(), session_id=name) for name in ("idle", "busy", "fresh"))
    idle.updated_at = busy.updated_at = 1_000.0
    fresh.updated_at = 1_900.0
    store.acquire("busy")
    assert store.expire_idle(600, now=2_000.0) == ["idle"]
    assert {s.session_id for s in store} == {"busy", "fresh"}
