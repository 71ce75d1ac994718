"""Session store: the in-memory backend (one gateway replica), and the API the Redis backend
(``gateway.redis_store``) implements too.

Every call that may reach a shared backend is async: ``create``, ``get``, ``delete``, ``acquire`` / ``hold`` /
``start_branch`` / ``release`` (a turn or append holds one branch of a session, ``Trajectory``; ``release`` keeps
what it changed), ``list_sessions`` and ``expire_idle``. The limit checks are about this process and stay
synchronous.

The store enforces the session limits (count, tokens per session, bytes held) and keeps the numbers the metrics
report (sessions, turns running, bytes held) as counters updated on every change, so that neither a
limit check nor a scrape ever walks the sessions.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, ClassVar, Protocol

import orjson

from gateway.errors import (
    SessionBusy,
    SessionClosed,
    SessionExists,
    SessionMismatch,
    SessionNotFound,
    SessionTooLong,
    StoreFull,
    TooManySessions,
)
from gateway.sample import SessionSample


class RunningTurn(Protocol):
    """A model turn in flight on a session, as the abort endpoint and shutdown see it."""

    rid: str

    def abort(self, reason: str) -> None: ...

    async def wait(self, timeout: float) -> bool: ...


BranchCause = str  # why a branch exists: "edited_history", "new_root", "rewrite" (None: the session's first)


@dataclass(eq=False)
class Branch:
    """One trajectory of a session, its own training sample. A token-level session has one; a chat session grows a
    tree (``gateway.chat.conversation``): a request that does not extend any branch's record forks a new branch from
    the one it shares the longest prefix with (``parent``, ``fork_token`` leading tokens in common), or starts a new
    root. A turn holds the branch it runs on (``busy``), so turns on different branches run concurrently."""

    # Where a branch stands in the tree besides its parent, as the view's branches[i], its sample's metadata and the
    # Redis store's branch field carry it.
    TREE_FIELDS: ClassVar[tuple[str, ...]] = (
        "fork_token",
        "first_difference",
        "cause",
        "model",
        "created_at",
        "updated_at",
    )

    sample: SessionSample
    record: Any = None  # a chat branch's message record (``gateway.chat.conversation.ChatRecord``), else None
    parent: Branch | None = None
    fork_token: int = 0  # leading tokens shared with the parent
    first_difference: int | None = None  # the first message of the request that forked it that differs from the parent
    cause: BranchCause | None = None
    model: str | None = None  # the model name of the request that started it
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    busy: bool = False
    running: RunningTurn | None = None

    @property
    def turns(self) -> int:
        """Turns on this branch (model turns and appended tokens: the turn log's entries)."""
        return len(self.sample.turns)

    def tree_fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.TREE_FIELDS}

    def touch(self) -> None:
        self.updated_at = time.time()


@dataclass(frozen=True, slots=True)
class SessionLimits:
    """A trainer's caps on one session's chat turns (slime's ``max_context_tokens`` and ``max_turns_per_sid``), set
    when it is created; None: no cap. ``sampling_defaults.max_new_tokens`` caps each chat answer besides."""

    max_context_tokens: int | None = None  # no branch longer: a prompt over it is refused, an answer cut to fit
    max_turns: int | None = None  # model turns over all its branches; past it a chat request is a 429

    def to_json(self) -> dict[str, Any]:
        return {"max_context_tokens": self.max_context_tokens, "max_turns": self.max_turns}

    @classmethod
    def from_json(cls, value: dict[str, Any] | None) -> SessionLimits:
        value = value or {}
        return cls(max_context_tokens=value.get("max_context_tokens"), max_turns=value.get("max_turns"))


@dataclass
class Session:
    session_id: str
    branches: list[Branch]  # [0]: the root, the token API's trajectory; the others in the order they were started
    metadata: dict[str, Any] = field(default_factory=dict)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    resume: bool = False  # the default of its token-level turns' ``resume`` (gateway.resume)
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    counted_bytes: int = 0  # stored_bytes when the store last counted it (see SessionStore.growing)
    limits: SessionLimits = field(default_factory=SessionLimits)
    closed: bool = False  # ``SessionStore.close``: no more turns (its samples are being taken)

    @classmethod
    def of(cls, session_id: str, sample: SessionSample, **fields: Any) -> Session:
        """A session of one (root) branch holding ``sample``."""
        return cls(session_id=session_id, branches=[Branch(sample)], **fields)

    @property
    def sample(self) -> SessionSample:
        """The root branch's sample: a token-level session's only one."""
        return self.branches[0].sample

    @property
    def root(self) -> Trajectory:
        return Trajectory(self, self.branches[0])

    @property
    def busy(self) -> bool:
        return any(branch.busy for branch in self.branches)

    @property
    def stored_bytes(self) -> int:
        return sum(branch.sample.stored_bytes for branch in self.branches)

    def index(self, branch: Branch) -> int:
        return next(i for i, known in enumerate(self.branches) if known is branch)

    def running_turns(self) -> list[RunningTurn]:
        """The turns running on its branches in this process (a chat session's branches may each run one)."""
        return [branch.running for branch in self.branches if branch.running is not None]

    def model_turns(self) -> int:
        """Model turns folded into any of its branches (each branch's turn log holds only its own)."""
        return sum(1 for branch in self.branches for turn in branch.sample.turns if turn.kind == "model")

    def check_open(self) -> None:
        """``SessionClosed`` once the session was closed (``SessionStore.close``)."""
        if self.closed:
            raise SessionClosed(
                f"session {self.session_id!r} is closed: its rollout is over and its samples are being taken",
                session_id=self.session_id,
            )

    def summary(self) -> dict[str, Any]:
        """What ``GET /v1/sessions`` lists and every view starts with: the root branch, and how many there are."""
        sample = self.sample
        return {
            "session_id": self.session_id,
            "status": sample.status.value,
            "busy": self.busy,
            "prompt_length": sample.prompt_length,
            "response_length": sample.response_length,
            "total_tokens": len(sample.tokens),
            "turns": len(sample.turns),
            "branch_count": len(self.branches),
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "last_error": last_error(self.sample),
        }

    def listing(self) -> dict[str, Any]:
        """A row of the session inspector's list (``SessionStore.list_page``)."""
        return self.summary() | {"branches": len(self.branches), "metadata": self.metadata}

    def branch_meta(self, branch: Branch) -> dict[str, Any]:
        """Where a branch stands in the tree: what the view's ``branches[i]`` and its sample's metadata carry."""
        return {
            "branch": self.index(branch),
            "parent": None if branch.parent is None else self.index(branch.parent),
            **branch.tree_fields(),
            "turns": branch.turns,
        }

    def touch(self) -> None:
        self.updated_at = time.time()


@dataclass(eq=False)
class Trajectory:
    """One branch of a session, as a turn runs on it (``gateway.turns``): the sample it folds into, the session's
    id and sampling defaults, the branch's running turn."""

    session: Session
    branch: Branch

    @property
    def session_id(self) -> str:
        return self.session.session_id

    @property
    def sample(self) -> SessionSample:
        return self.branch.sample

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        return self.session.sampling_defaults

    @property
    def index(self) -> int:
        return self.session.index(self.branch)

    @property
    def running(self) -> RunningTurn | None:
        return self.branch.running

    @running.setter
    def running(self, turn: RunningTurn | None) -> None:
        self.branch.running = turn

    def check_sync(self, total_tokens: int, last_tokens: list[int]) -> None:
        """Raise ``SessionMismatch`` unless the branch holds ``total_tokens`` tokens ending with ``last_tokens``
        (what a caller keeping its own copy believes), naming what it does hold."""
        tokens = self.sample.tokens.view()
        if len(tokens) == total_tokens and tokens[len(tokens) - len(last_tokens) :].tolist() == last_tokens:
            return
        raise SessionMismatch(
            f"session {self.session_id!r} holds {len(tokens)} tokens, not the {total_tokens} the request expects "
            "(or they end differently)",
            session_id=self.session_id,
            total_tokens=len(tokens),
            last_tokens=tokens[-len(last_tokens) :].tolist() if last_tokens else [],
        )


def last_error(sample: SessionSample) -> str | None:
    """Why a trajectory's last model turn ended early (an abort: the caller's, a hang-up, the upstream's),
    or None when it ended normally. Failed turns leave no trace: they change nothing (all or nothing)."""
    for turn in reversed(sample.turns):
        if turn.kind == "model":
            finish = turn.finish_reason or {}
            if finish.get("type") in (None, "stop", "length"):
                return None
            return str(finish.get("message") or finish.get("type"))
    return None


@dataclass(frozen=True, slots=True)
class SessionQuery:
    """One page of the session list, newest first: sessions with this ``status`` (None: any) whose metadata holds
    every ``metadata`` key with that value (a string, compared with the value's text: ``"7"`` matches ``7``)."""

    status: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    offset: int = 0
    limit: int = 50

    @property
    def filtered(self) -> bool:
        return self.status is not None or bool(self.metadata)

    def matches(self, status: str, metadata: Mapping[str, Any]) -> bool:
        if self.status is not None and status != self.status:
            return False
        for key, wanted in self.metadata.items():
            value = metadata.get(key, _MISSING)
            if value is _MISSING or (value != wanted and _as_text(value) != wanted):  # a string compares as is
                return False
        return True


_MISSING = object()


def page_of(rows: list[dict[str, Any]], query: SessionQuery) -> tuple[int, list[dict[str, Any]]]:
    """``SessionStore.list_page`` over listing rows that are already built (a store whose sessions live elsewhere:
    Redis); rows without ``metadata`` match no metadata filter."""
    matching = [row for row in rows if query.matches(row["status"], row.get("metadata") or {})]
    matching.sort(key=lambda row: row["created_at"], reverse=True)
    page = matching[query.offset : query.offset + query.limit]
    return len(matching), page


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else orjson.dumps(value).decode()


class SessionStore:
    """Sessions by id. All access happens on the event loop, so the busy flag and the counters need no lock.

    ``max_session_tokens`` and ``max_stored_bytes`` of None mean no limit.
    """

    def __init__(
        self, max_sessions: int, *, max_session_tokens: int | None = None, max_stored_bytes: int | None = None
    ) -> None:
        self._sessions: dict[str, Session] = {}
        self._max_sessions = max_sessions
        self._max_session_tokens = max_session_tokens
        self._max_stored_bytes = max_stored_bytes
        self._stored_bytes = 0
        self._active = 0

    @property
    def count(self) -> int:
        """Sessions held (a shared backend: as of its last count), O(1)."""
        return len(self._sessions)

    async def start(self) -> None:
        """Connect, where there is anything to connect to."""

    async def aclose(self) -> None:
        """Let go of what ``start`` took."""

    async def list_sessions(self) -> list[dict[str, Any]]:
        return [session.summary() for session in list(self._sessions.values())]

    async def list_page(self, query: SessionQuery) -> tuple[int, list[dict[str, Any]]]:
        """(sessions matching ``query``, the page's ``Session.listing`` rows), newest first. Only the page's rows are
        built: without a filter a page costs O(offset + limit), with one a scan of cheap checks (a fraction of what
        building every summary costs), never 100k summaries."""
        newest_first: Iterator[Session] = reversed(self._sessions.values())  # insertion order is creation order
        if query.filtered:
            # Status is a StrEnum: compared as the string it is (its .value is a slow property)
            matching = [s for s in newest_first if query.matches(s.sample.status, s.metadata)]
            total, newest_first = len(matching), iter(matching)
        else:
            total = len(self._sessions)
        return total, [s.listing() for s in islice(newest_first, query.offset, query.offset + query.limit)]

    async def holder(self, session_id: str) -> str | None:
        """The gateway instance running a turn on the session, if another one is (a shared backend)."""
        return None

    # ---- gateway-wide actions (``gateway.fleet``): nobody else to tell in one process -----------------------------
    shared: ClassVar[bool] = False  # whether other gateway replicas share these sessions
    listening: bool | None = None  # whether this replica hears the others' actions (None: there are none)

    async def broadcast(self, message: dict[str, Any]) -> int:
        """Tell every other replica sharing the store (``gateway.fleet``); how many subscribers got it."""
        return 0

    async def listen(self, on_message: Callable[[dict[str, Any]], None]) -> None:
        """Call ``on_message`` with each message another replica broadcasts, until cancelled."""

    async def create(
        self,
        sample: SessionSample,
        *,
        session_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        sampling_defaults: dict[str, Any] | None = None,
        limits: SessionLimits | None = None,
        resume: bool = False,
    ) -> Session:
        if session_id is not None and session_id in self._sessions:
            raise SessionExists(f"session {session_id!r} already exists", session_id=session_id)
        self._check_session_count(len(self._sessions))
        session = self._new_session(sample, session_id, metadata, sampling_defaults, limits, resume)
        self._register(session)
        return session

    def _new_session(
        self,
        sample: SessionSample,
        session_id: str | None,
        metadata: dict[str, Any] | None,
        sampling_defaults: dict[str, Any] | None,
        limits: SessionLimits | None = None,
        resume: bool = False,
    ) -> Session:
        """A new session, checked against the limits of this process; not stored yet."""
        self._check_tokens(len(sample.tokens), "the prompt has")
        self._check_store_room(sample.stored_bytes)
        return Session.of(
            session_id or uuid.uuid4().hex,
            sample,
            metadata=metadata or {},
            sampling_defaults=sampling_defaults or {},
            limits=limits or SessionLimits(),
            resume=resume,
        )

    def _check_session_count(self, held: int) -> None:
        if held >= self._max_sessions:
            raise TooManySessions(
                f"the gateway already holds {held} sessions",
                setting="GATEWAY_MAX_SESSIONS",
                limit=self._max_sessions,
            )

    def _register(self, session: Session) -> None:
        """Hold ``session`` in this process (replacing an older copy), counting its bytes."""
        old = self._sessions.get(session.session_id)
        if old is not None:
            self._stored_bytes -= old.counted_bytes
        session.counted_bytes = session.stored_bytes
        self._sessions[session.session_id] = session
        self._stored_bytes += session.counted_bytes

    async def get(self, session_id: str) -> Session:
        return self.local(session_id)

    def local(self, session_id: str) -> Session:
        """The session as this process holds it (no backend round trip)."""
        try:
            return self._sessions[session_id]
        except KeyError:
            raise SessionNotFound(f"no session {session_id!r}", session_id=session_id) from None

    async def close(self, session_id: str) -> Session:
        """Mark the session closed: every turn asked for from now on is refused (``SessionClosed``); turns already
        running go on (``gateway.closing`` waits for them). Idempotent."""
        session = self.local(session_id)
        session.closed = True
        return session

    async def delete(self, session_id: str) -> None:
        session = self.local(session_id)
        if session.busy:
            raise SessionBusy(f"session {session_id!r} has a turn running; abort or wait for it first")
        self._drop(session)

    async def acquire(self, session_id: str) -> Trajectory:
        """Hold the session's root branch for one token-level turn or append: a second one is a 409."""
        session = await self.get(session_id)
        return await self.hold(session, session.branches[0])

    async def hold(self, session: Session, branch: Branch) -> Trajectory:
        """Hold one branch of ``session`` (as ``get`` returned it) for a turn: another turn on the same branch is a
        409; turns on other branches go on. A shared backend checks that the branch is still as ``session`` shows it
        (``SessionBusy`` otherwise: it changed meanwhile, retry)."""
        if branch.busy:
            raise SessionBusy(
                f"session {session.session_id!r} already has a turn running on branch {session.index(branch)}",
                session_id=session.session_id,
                branch=session.index(branch),
            )
        branch.busy = True
        self._active += 1
        return Trajectory(session, branch)

    async def start_branch(self, session: Session, branch: Branch) -> Trajectory:
        """Add ``branch`` to the session's tree and hold it for the turn that starts it."""
        session.branches.append(branch)
        try:
            trajectory = await self.hold(session, branch)
        except BaseException:
            session.branches.remove(branch)
            raise
        self.recount(session)
        return trajectory

    def drop_branch(self, trajectory: Trajectory) -> None:
        """Undo ``start_branch`` (the turn that started the branch failed), before ``release``."""
        session = trajectory.session
        if trajectory.branch in session.branches:
            session.branches.remove(trajectory.branch)
        self.recount(session)

    async def release(self, trajectory: Trajectory) -> None:
        """End a turn or append: what it changed is kept (a shared backend: written, or ``StoreUnavailable``)."""
        self._unhold(trajectory)

    def _unhold(self, trajectory: Trajectory) -> None:
        branch = trajectory.branch
        if branch.busy:
            self._active -= 1
        branch.busy = False
        branch.running = None
        trajectory.session.touch()  # activity (the idle sweep); the branch's updated_at moves only when it changes

    @asynccontextmanager
    async def exclusive(self, session_id: str) -> AsyncIterator[Trajectory]:
        trajectory = await self.acquire(session_id)
        try:
            yield trajectory
        finally:
            await self.release(trajectory)

    def running_turns(self) -> list[RunningTurn]:
        return [turn for session in self._sessions.values() for turn in session.running_turns()]

    async def expire_idle(self, ttl_s: float, now: float | None = None) -> list[str]:
        """Drop sessions untouched for ``ttl_s`` (abandoned rollouts); a session with a turn running stays."""
        cutoff = (time.time() if now is None else now) - ttl_s
        expired = [s for s in self._sessions.values() if not s.busy and s.updated_at < cutoff]
        for session in expired:
            self._drop(session)
        return [s.session_id for s in expired]

    # ---- limits and counters -------------------------------------------------------------------------------------
    def check_growth(self, trajectory: Trajectory, new_tokens: int = 1) -> None:
        """Admit a model turn (``new_tokens=1``: room for at least one token) or an append of ``new_tokens`` before
        anything is sent or changed: SessionTooLong past max_session_tokens, StoreFull once the sessions hold
        max_stored_bytes. A turn admitted here is checked again on its answer (``growing``)."""
        self.check_room(trajectory, new_tokens)
        self._check_store_room(0)

    def check_room(self, trajectory: Trajectory, new_tokens: int) -> None:
        """SessionTooLong if ``new_tokens`` more would take the branch past max_session_tokens. The fold path calls
        this (through ``growing``) on the upstream's answer, and a streamed turn on each delta, before folding."""
        self._check_tokens(len(trajectory.sample.tokens) + new_tokens, "the session would hold")

    @contextmanager
    def growing(self, trajectory: Trajectory, new_tokens: int) -> Iterator[None]:
        """Wrap one fold of ``new_tokens`` into a branch: refused first (``check_room``) if it would pass the
        token limit, then the byte count is brought up to date, whether the fold completed or not.

        The byte limit is not checked here: a turn admitted by ``check_growth`` is folded even if other sessions
        filled the store meanwhile (refusing it then would throw away the upstream's work, or an aborted turn's
        tokens); the overshoot is bounded by the turns in flight.
        """
        self.check_room(trajectory, new_tokens)
        try:
            yield
        finally:
            self.recount(trajectory.session)

    @property
    def stored_bytes(self) -> int:
        """Bytes of session arrays held (slack included), O(1)."""
        return self._stored_bytes

    @property
    def active(self) -> int:
        """Turns or appends running (one per busy branch), O(1)."""
        return self._active

    def _check_tokens(self, total: int, what: str) -> None:
        limit = self._max_session_tokens
        if limit is not None and total > limit:
            raise SessionTooLong(
                f"{what} {total} tokens, over the limit of {limit} per session",
                setting="GATEWAY_MAX_SESSION_TOKENS",
                limit=limit,
                tokens=total,
            )

    def _check_store_room(self, new_bytes: int) -> None:
        limit = self._max_stored_bytes
        if limit is None:
            return
        if self._stored_bytes >= limit or (new_bytes and self._stored_bytes + new_bytes > limit):
            raise StoreFull(
                f"the sessions hold {self._stored_bytes} bytes, at the limit of {limit}: delete sessions (or let "
                "them expire) to make room",
                setting="GATEWAY_MAX_STORED_BYTES",
                limit=limit,
                stored_bytes=self._stored_bytes,
            )

    def recount(self, session: Session) -> None:
        """Bring the byte count up to date after ``session`` changed. O(1) per trajectory: a sample's byte count is
        the sum over its few buffers."""
        now = session.stored_bytes
        self._stored_bytes += now - session.counted_bytes
        session.counted_bytes = now

    def _drop(self, session: Session) -> None:
        del self._sessions[session.session_id]
        self._stored_bytes -= session.counted_bytes  # never busy: delete refuses a busy session, expiry skips it
