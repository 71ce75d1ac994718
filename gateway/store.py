"""Session store: the in-memory backend (one gateway replica). A Redis backend would implement the same API."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.errors import SessionBusy, SessionExists, SessionNotFound, TooManySessions
from gateway.sample import SessionSample


class RunningTurn(Protocol):
    """A model turn in flight on a session, as the abort endpoint and shutdown see it."""

    rid: str

    def abort(self, reason: str) -> None: ...

    async def wait(self, timeout: float) -> bool: ...


@dataclass
class Session:
    session_id: str
    sample: SessionSample
    metadata: dict[str, Any] = field(default_factory=dict)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    busy: bool = False
    running: RunningTurn | None = None

    def touch(self) -> None:
        self.updated_at = time.time()


class SessionStore:
    """Sessions by id. All access happens on the event loop, so the busy flag needs no lock."""

    def __init__(self, max_sessions: int) -> None:
        self._sessions: dict[str, Session] = {}
        self._max_sessions = max_sessions

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    def create(
        self,
        sample: SessionSample,
        *,
        session_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        sampling_defaults: dict[str, Any] | None = None,
    ) -> Session:
        if session_id is not None and session_id in self._sessions:
            raise SessionExists(f"session {session_id!r} already exists", session_id=session_id)
        if len(self._sessions) >= self._max_sessions:
            raise TooManySessions(f"the gateway already holds {len(self._sessions)} sessions (max_sessions)")
        session = Session(
            session_id=session_id or uuid.uuid4().hex,
            sample=sample,
            metadata=metadata or {},
            sampling_defaults=sampling_defaults or {},
        )
        self._sessions[session.session_id] = session
        return session

    def get(self, session_id: str) -> Session:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise SessionNotFound(f"no session {session_id!r}", session_id=session_id) from None

    def delete(self, session_id: str) -> None:
        session = self.get(session_id)
        if session.busy:
            raise SessionBusy(f"session {session_id!r} has a turn running; abort or wait for it first")
        del self._sessions[session_id]

    def acquire(self, session_id: str) -> Session:
        """Hold the session for one turn or append: a second one on the same session is a 409."""
        session = self.get(session_id)
        if session.busy:
            raise SessionBusy(f"session {session_id!r} already has a turn running", session_id=session_id)
        session.busy = True
        return session

    @staticmethod
    def release(session: Session) -> None:
        session.busy = False
        session.running = None
        session.touch()

    @asynccontextmanager
    async def exclusive(self, session_id: str) -> AsyncIterator[Session]:
        session = self.acquire(session_id)
        try:
            yield session
        finally:
            self.release(session)

    def running_turns(self) -> list[RunningTurn]:
        return [s.running for s in self._sessions.values() if s.running is not None]

    def expire_idle(self, ttl_s: float, now: float | None = None) -> list[str]:
        """Drop sessions untouched for ``ttl_s`` (abandoned rollouts); a session with a turn running stays."""
        cutoff = (time.time() if now is None else now) - ttl_s
        expired = [s.session_id for s in self._sessions.values() if not s.busy and s.updated_at < cutoff]
        for session_id in expired:
            del self._sessions[session_id]
        return expired

    @property
    def stored_bytes(self) -> int:
        return sum(s.sample.stored_bytes for s in self._sessions.values())
