"""The in-memory session store: exclusivity, limits and idle expiry (unit tests of one layer)."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.errors import SessionBusy, SessionExists, SessionNotFound, SessionTooLong, StoreFull, TooManySessions
from gateway.sample import SessionSample
from gateway.store import SessionStore


def sample() -> SessionSample:
    return SessionSample.from_prompt([1, 2, 3])


async def test_ids_are_unique_and_lookups_fail_clearly() -> None:
    store = SessionStore(max_sessions=10)
    session = await store.create(sample(), session_id="a")
    assert await store.get("a") is session
    with pytest.raises(SessionExists):
        await store.create(sample(), session_id="a")
    with pytest.raises(SessionNotFound):
        await store.get("b")
    generated = await store.create(sample())
    assert len(generated.session_id) == 32 and store.count == 2


async def test_max_sessions_is_a_429() -> None:
    store = SessionStore(max_sessions=1)
    await store.create(sample())
    with pytest.raises(TooManySessions) as caught:
        await store.create(sample())
    assert caught.value.status_code == 429


async def test_exclusive_holds_the_session_and_releases_it_on_error() -> None:
    store = SessionStore(max_sessions=10)
    await store.create(sample(), session_id="a")
    with pytest.raises(RuntimeError):
        async with store.exclusive("a") as session:
            assert session.busy
            with pytest.raises(SessionBusy):
                await store.acquire("a")
            with pytest.raises(SessionBusy):
                await store.delete("a")
            raise RuntimeError("the turn failed")
    assert not (await store.get("a")).busy
    await store.delete("a")
    assert store.count == 0


async def test_idle_sessions_expire_but_busy_ones_stay() -> None:
    store = SessionStore(max_sessions=10)
    idle, busy, fresh = [await store.create(sample(), session_id=name) for name in ("idle", "busy", "fresh")]
    idle.updated_at = busy.updated_at = 1_000.0
    fresh.updated_at = 1_900.0
    await store.acquire("busy")
    assert await store.expire_idle(600, now=2_000.0) == ["idle"]
    assert {s["session_id"] for s in await store.list_sessions()} == {"busy", "fresh"}


# ---- limits and O(1) counters ------------------------------------------------------------------------------------
def walked(store: SessionStore) -> tuple[int, int, int]:
    """What the counters must equal: a walk over the sessions."""
    sessions = [store.local(summary["session_id"]) for summary in store_summaries(store)]
    return len(sessions), sum(s.busy for s in sessions), sum(s.sample.stored_bytes for s in sessions)


def store_summaries(store: SessionStore) -> list[dict]:
    return [session.summary() for session in store._sessions.values()]


def counted(store: SessionStore) -> tuple[int, int, int]:
    return store.count, store.active, store.stored_bytes


async def test_counters_follow_every_change_without_a_walk() -> None:
    store = SessionStore(max_sessions=10)
    _, b, c = [
        await store.create(SessionSample.from_prompt(list(range(n))), session_id=name)
        for name, n in (("a", 3), ("b", 100), ("c", 7))
    ]
    assert counted(store) == walked(store) == (3, 0, 4 * 110)
    held = await store.acquire("b")
    assert counted(store) == walked(store)
    with store.growing(held, 300):
        held.sample.append_tool_tokens(np.arange(300, dtype=np.int32))
    await store.release(held)
    await store.release(held)  # a second release changes nothing
    assert counted(store) == walked(store) and store.active == 0
    await store.delete("a")
    c.updated_at = 0.0
    assert await store.expire_idle(600) == ["c"]
    assert counted(store) == walked(store) == (1, 0, b.sample.stored_bytes)


async def test_token_limit_at_create_and_on_growth() -> None:
    store = SessionStore(max_sessions=10, max_session_tokens=10)
    with pytest.raises(SessionTooLong) as caught:
        await store.create(SessionSample.from_prompt(list(range(11))))
    assert caught.value.status_code == 413 and caught.value.details["limit"] == 10
    session = await store.create(SessionSample.from_prompt(list(range(8))), session_id="s")
    store.check_growth(session, 2)
    with pytest.raises(SessionTooLong):
        store.check_growth(session, 3)
    before = store.stored_bytes
    with pytest.raises(SessionTooLong), store.growing(session, 3):
        raise AssertionError("not reached: refused before the fold runs")
    assert store.stored_bytes == before and len(session.sample.tokens) == 8


async def test_byte_limit_refuses_new_sessions_and_growth_but_not_admitted_folds() -> None:
    store = SessionStore(max_sessions=10, max_stored_bytes=100)
    sessions = [await store.create(SessionSample.from_prompt(list(range(6)))) for _ in range(4)]  # 4 x 24 bytes
    with pytest.raises(StoreFull) as caught:
        await store.create(SessionSample.from_prompt(list(range(6))))  # would cross the limit
    assert caught.value.status_code == 507
    store.check_growth(sessions[0])  # 96 < 100: admitted
    with store.growing(sessions[0], 50):  # a fold of an admitted turn is never refused for bytes
        sessions[0].sample.append_tool_tokens(np.arange(50, dtype=np.int32))
    assert store.stored_bytes >= 100
    with pytest.raises(StoreFull):
        store.check_growth(sessions[1])
    await store.delete(sessions[0].session_id)
    store.check_growth(sessions[1])
    assert counted(store) == walked(store)
