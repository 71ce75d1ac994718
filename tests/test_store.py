"""The in-memory session store: exclusivity, limits and idle expiry (unit tests of one layer)."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.errors import SessionBusy, SessionExists, SessionNotFound, SessionTooLong, StoreFull, TooManySessions
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


# ---- limits and O(1) counters ------------------------------------------------------------------------------------
def walked(store: SessionStore) -> tuple[int, int, int]:
    """What the counters must equal: a walk over the sessions."""
    sessions = list(store)
    return len(sessions), sum(s.busy for s in sessions), sum(s.sample.stored_bytes for s in sessions)


def counted(store: SessionStore) -> tuple[int, int, int]:
    return len(store), store.active, store.stored_bytes


def test_counters_follow_every_change_without_a_walk() -> None:
    store = SessionStore(max_sessions=10)
    _, b, c = (
        store.create(SessionSample.from_prompt(list(range(n))), session_id=name)
        for name, n in (("a", 3), ("b", 100), ("c", 7))
    )
    assert counted(store) == walked(store) == (3, 0, 4 * 110)
    held = store.acquire("b")
    assert counted(store) == walked(store)
    with store.growing(held, 300):
        held.sample.append_tool_tokens(np.arange(300, dtype=np.int32))
    store.release(held)
    store.release(held)  # a second release changes nothing
    assert counted(store) == walked(store) and store.active == 0
    store.delete("a")
    c.updated_at = 0.0
    assert store.expire_idle(600) == ["c"]
    assert counted(store) == walked(store) == (1, 0, b.sample.stored_bytes)


def test_token_limit_at_create_and_on_growth() -> None:
    store = SessionStore(max_sessions=10, max_session_tokens=10)
    with pytest.raises(SessionTooLong) as caught:
        store.create(SessionSample.from_prompt(list(range(11))))
    assert caught.value.status_code == 413 and caught.value.details["limit"] == 10
    session = store.create(SessionSample.from_prompt(list(range(8))), session_id="s")
    store.check_growth(session, 2)
    with pytest.raises(SessionTooLong):
        store.check_growth(session, 3)
    before = store.stored_bytes
    with pytest.raises(SessionTooLong), store.growing(session, 3):
        raise AssertionError("not reached: refused before the fold runs")
    assert store.stored_bytes == before and len(session.sample.tokens) == 8


def test_byte_limit_refuses_new_sessions_and_growth_but_not_admitted_folds() -> None:
    store = SessionStore(max_sessions=10, max_stored_bytes=100)
    sessions = [store.create(SessionSample.from_prompt(list(range(6)))) for _ in range(4)]  # 4 x 24 bytes
    with pytest.raises(StoreFull) as caught:
        store.create(SessionSample.from_prompt(list(range(6))))  # would cross the limit
    assert caught.value.status_code == 507
    store.check_growth(sessions[0])  # 96 < 100: admitted
    with store.growing(sessions[0], 50):  # a fold of an admitted turn is never refused for bytes
        sessions[0].sample.append_tool_tokens(np.arange(50, dtype=np.int32))
    assert store.stored_bytes >= 100
    with pytest.raises(StoreFull):
        store.check_growth(sessions[1])
    store.delete(sessions[0].session_id)
    store.check_growth(sessions[1])
    assert counted(store) == walked(store)
