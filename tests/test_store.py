"""The in-memory session store: exclusivity, limits and idle expiry (unit tests of one layer)."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.errors import SessionBusy, SessionExists, SessionNotFound, SessionTooLong, StoreFull, TooManySessions
from gateway.sample import SessionSample
from gateway.store import Branch, SessionStore


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
        async with store.exclusive("a") as held:
            assert held.branch.busy and held.session.busy and held.index == 0
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
    busy = sum(branch.busy for s in sessions for branch in s.branches)
    return len(sessions), busy, sum(branch.sample.stored_bytes for s in sessions for branch in s.branches)


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
    store.check_growth(session.root, 2)
    with pytest.raises(SessionTooLong):
        store.check_growth(session.root, 3)
    before = store.stored_bytes
    with pytest.raises(SessionTooLong), store.growing(session.root, 3):
        raise AssertionError("not reached: refused before the fold runs")
    assert store.stored_bytes == before and len(session.sample.tokens) == 8


async def test_byte_limit_refuses_new_sessions_and_growth_but_not_admitted_folds() -> None:
    store = SessionStore(max_sessions=10, max_stored_bytes=100)
    sessions = [await store.create(SessionSample.from_prompt(list(range(6)))) for _ in range(4)]  # 4 x 24 bytes
    with pytest.raises(StoreFull) as caught:
        await store.create(SessionSample.from_prompt(list(range(6))))  # would cross the limit
    assert caught.value.status_code == 507
    store.check_growth(sessions[0].root)  # 96 < 100: admitted
    with store.growing(sessions[0].root, 50):  # a fold of an admitted turn is never refused for bytes
        sessions[0].sample.append_tool_tokens(np.arange(50, dtype=np.int32))
    assert store.stored_bytes >= 100
    with pytest.raises(StoreFull):
        store.check_growth(sessions[1].root)
    await store.delete(sessions[0].session_id)
    store.check_growth(sessions[1].root)
    assert counted(store) == walked(store)


async def test_branches_are_held_one_by_one_and_a_failed_new_one_is_dropped() -> None:
    """Turns on different branches of one session run at once; the same branch twice is a 409; a branch started
    for a turn that failed leaves no trace, in the tree or the counters."""
    store = SessionStore(max_sessions=10)
    session = await store.create(SessionSample.from_prompt(list(range(4))), session_id="tree")
    root = await store.acquire("tree")
    side = await store.start_branch(session, Branch(session.sample.branch(2), parent=session.branches[0], fork_token=2))
    assert [t.index for t in (root, side)] == [0, 1] and store.active == 2 and counted(store) == walked(store)
    with pytest.raises(SessionBusy) as busy:
        await store.hold(session, side.branch)
    assert busy.value.details["branch"] == 1
    with pytest.raises(SessionBusy):
        await store.delete("tree")  # a turn runs on some branch
    await store.release(root)
    failed = await store.start_branch(session, Branch(session.sample.branch(0)))
    failed.sample.append_prompt_tokens(np.arange(50, dtype=np.int32))
    store.recount(session)
    assert len(session.branches) == 3 and session.index(failed.branch) == 2
    store.drop_branch(failed)
    await store.release(failed)
    assert len(session.branches) == 2 and store.active == 1 and counted(store) == walked(store)
    assert session.branch_meta(side.branch) | {"created_at": 0, "updated_at": 0} == {
        "branch": 1,
        "parent": 0,
        "fork_token": 2,
        "first_difference": None,
        "cause": None,
        "model": None,
        "created_at": 0,
        "updated_at": 0,
        "turns": 0,
    }
    await store.release(side)
    assert not session.busy and store.active == 0
