"""One model turn of a session, as a small state machine: plan, submit, receive (one JSON answer, or SGLang's
cumulative SSE turned into deltas for the caller), and when the engine aborted the answer without anyone on this
side asking (a weight update's pause), plan the continuation and submit again (``gateway.resume``); then fold once.

Two shapes share the planning, the resume decision and the fold: a unary turn and a streamed one. A streamed turn
runs in its own task, independent of the caller's connection, so an abort, a cut client or a dying upstream always
ends in a coherent session; its caller reads one stream of deltas, with no seam where the turn was resumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import orjson

from gateway.buffers import GrowableArray
from gateway.codec import (
    SSE_DONE,
    AnswerBytes,
    CumulativeStreamDecoder,
    DecodedTurn,
    StreamDelta,
    answer_rid,
    decode_answer,
    decode_generate_response,
    stream_error_payload,
)
from gateway.errors import (
    GatewayError,
    LimitExceeded,
    SessionConflict,
    TurnAborted,
    TurnInterrupted,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamRejected,
    UpstreamUnavailable,
)
from gateway.metrics import GatewayMetrics
from gateway.offload import CpuPool
from gateway.resume import Submission, TurnDraft, engine_abort
from gateway.sample import ModelTurnPlan
from gateway.schemas import TurnCreate
from gateway.store import RunningTurn, SessionStore, Trajectory
from gateway.upstream import Upstream
from slime_wire.http1 import Body, Response
from slime_wire.sse import SSEDecoder, SSEError

log = logging.getLogger("gateway.turns")
T = TypeVar("T")

TOP_P_FLAG = "return_top_p_token_ids"
# After an abort, how long the upstream gets to end the stream itself (with its final chunk and replay data)
# before the gateway closes the connection and folds what it has.
ABORT_GRACE_S = 3.0
# After aborting turns on this side: how long they get to fold what they have and let go of their branches.
ABORT_SETTLE_S = ABORT_GRACE_S + 2.0
# After a stream's final chunk, how long the rest of the body ([DONE], the last chunk of the framing) may take.
STREAM_TAIL_S = 1.0
# A resuming request the upstream refuses (unreachable, 503: not taking requests while its weights are updated) is
# sent again after this pause, doubled each time up to the cap, until the turn's deadline.
RESUME_RETRY_FIRST_S = 0.25
RESUME_RETRY_MAX_S = 5.0
# A resumption is not started with less than this left of the turn's deadline.
RESUME_MIN_TIME_S = 1.0


@dataclass(frozen=True, slots=True)
class TurnPlan:
    """What this turn asks of SGLang, decided from the request and the session before anything is sent."""

    rid: str
    want_routing: bool
    want_top_p: bool
    routing_start_len: int
    sampling_params: dict[str, Any]
    prompt_length: int
    resume: bool = False  # resubmit when the engine aborts the answer (the request's choice, or the session's)


def plan_turn(trajectory: Trajectory, request: TurnCreate, *, incremental_routing: bool = True) -> TurnPlan:
    trajectory.session.check_open()
    if request.sync is not None:
        trajectory.check_sync(request.sync.total_tokens, request.sync.last_tokens)
    sample = trajectory.sample
    # What the session is like now refuses these (valid) bodies: 409, a conflict with the session's state.
    if not len(sample.tokens):
        raise SessionConflict(
            f"session {trajectory.session_id!r} has no prompt yet: a session created without prompt_ids is a chat "
            "session, whose first chat request renders its prompt"
        )
    want_routing = sample.moe is not None if request.return_routed_experts is None else request.return_routed_experts
    if want_routing and sample.moe is None:
        raise SessionConflict(
            "return_routed_experts needs the session's MoE shape: create it with num_layers and moe_router_topk"
        )
    sampling_params = trajectory.sampling_defaults | request.sampling_params
    custom = dict(sampling_params.get("custom_params") or {})
    # Once a session keeps top-p spans, every model turn must bring them (slime's fold requires it).
    want_top_p = bool(custom.get(TOP_P_FLAG)) or sample.top_p_active
    if want_top_p:
        sample.check_can_request_top_p()
        custom[TOP_P_FLAG] = True
        sampling_params = sampling_params | {"custom_params": custom}
    return TurnPlan(
        rid=f"{trajectory.session_id}-{len(sample.turns)}-{uuid.uuid4().hex[:8]}",
        want_routing=want_routing,
        want_top_p=want_top_p,
        routing_start_len=sample.routing_rows if want_routing and incremental_routing else 0,
        sampling_params=sampling_params,
        prompt_length=len(sample.tokens),
        resume=trajectory.session.resume if request.resume is None else request.resume,
    )


def upstream_payload(
    trajectory: Trajectory, plan: TurnPlan, submission: Submission | None = None, *, stream: bool = False
) -> bytes:
    """The ``/generate`` body of the turn's first request, or of ``submission`` (a resumption: the turn's tokens
    so far after the branch's, the length left, the rows from where the turn's end)."""
    tokens = trajectory.sample.tokens.view()
    if submission is not None and submission.generated is not None:
        tokens = np.concatenate([tokens, submission.generated])
    start = plan.routing_start_len if submission is None else submission.routing_start_len
    payload: dict[str, Any] = {
        "input_ids": tokens,
        "sampling_params": plan.sampling_params if submission is None else submission.sampling_params,
        "return_logprob": True,
        "rid": plan.rid if submission is None else submission.rid,
    }
    if plan.want_routing:
        payload["return_routed_experts"] = True
        if start:
            payload["routed_experts_start_len"] = start
    if stream:
        payload["stream"] = True
    return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)


def turn_summary(
    trajectory: Trajectory, plan: TurnPlan, model_turn: ModelTurnPlan, *, resumed: int = 0
) -> dict[str, Any]:
    """What the caller gets back for a turn, from the session as it is now and the planned fold (so that it can be
    built, and serialized, before the session changes)."""
    sample, turn = trajectory.sample, model_turn.turn
    return {
        "session_id": trajectory.session_id,
        "turn": len(sample.turns),
        "rid": turn.rid or plan.rid,
        "new_token_ids": turn.token_ids.tolist(),
        "text": turn.text,
        "finish_reason": turn.finish_reason,
        "status": model_turn.status_after.value,
        "prompt_length": plan.prompt_length,
        "completion_tokens": turn.num_tokens,
        "response_length": sample.response_length + turn.num_tokens,
        "total_tokens": len(sample.tokens) + turn.num_tokens,
        "cached_tokens": turn.cached_tokens,
        "prompt_tokens": turn.prompt_tokens,
        "weight_version": turn.weight_version,
        "routed_experts_start_len": plan.routing_start_len if plan.want_routing else None,
        "routed_experts_rows_received": model_turn.record.routing_rows,
        "routed_experts_rows": model_turn.routing_rows_after,
        "top_p_replay": plan.want_top_p,
        "spec_counters": turn.spec_counters,
        "resumed": resumed,
    }


@dataclass(frozen=True, slots=True)
class FoldedTurn:
    """A turn folded into its session: the caller's summary, and the plan that was applied (its arrays are this
    turn's own tensors, see ``gateway.views.turn_payload``)."""

    summary: dict[str, Any]
    plan: ModelTurnPlan
    version_table: tuple[str, ...]  # the session's weight version table after the fold
    resumed: int = 0  # times the engine aborted it and it was resubmitted
    # Why the turn ended before the model ended it, for a client that must not take it for an answer (a chat
    # client): the trainer aborted it (TurnAborted), or the engine did and it could not be resumed (TurnInterrupted).
    # None when the model ended it (stop, length), and for a turn whose caller left.
    error: GatewayError | None = None


class TurnRunner:
    """Runs the model turns of every session: built once by the app lifespan with what a turn uses (the upstream,
    the CPU pool, the store, the metrics) and handed to the token routes and the chat service.

    ``resume_max``: how many times one turn is resubmitted after engine aborts (``GATEWAY_RESUME_MAX``; 0: never);
    ``deadline_s``: how long one turn may take, its resumptions included (``GATEWAY_REQUEST_TIMEOUT_S``)."""

    def __init__(
        self,
        upstream: Upstream,
        store: SessionStore,
        cpu: CpuPool,
        metrics: GatewayMetrics,
        *,
        incremental_routing: bool = True,
        resume_max: int = 0,
        deadline_s: float | None = None,
    ) -> None:
        self.upstream = upstream
        self.store = store
        self.cpu = cpu
        self.metrics = metrics
        self.incremental_routing = incremental_routing
        self.resume_max = resume_max
        self.deadline_s = upstream.timeout_s if deadline_s is None else deadline_s

    def plan(self, trajectory: Trajectory, request: TurnCreate) -> TurnPlan:
        return plan_turn(trajectory, request, incremental_routing=self.incremental_routing)

    async def run(self, trajectory: Trajectory, request: TurnCreate) -> FoldedTurn:
        """A unary turn; runs with the branch held (see ``SessionStore.exclusive``)."""
        return await UnaryTurn(self, trajectory, self.plan(trajectory, request)).run()

    async def open_stream(
        self, trajectory: Trajectory, request: TurnCreate, *, on_end: TurnEndHook | None = None
    ) -> StreamTurn:
        """Plan and open the upstream stream; errors before the first byte are plain HTTP errors for the caller."""
        plan = self.plan(trajectory, request)
        response = await self.upstream.open_generate_stream(
            upstream_payload(trajectory, plan, stream=True), routing_key=trajectory.session_id
        )
        return StreamTurn(self, trajectory, plan, response, on_end=on_end)

    def fold(
        self,
        trajectory: Trajectory,
        plan: TurnPlan,
        turn: DecodedTurn,
        *,
        partial: bool = False,
        resumed: int = 0,
        routing_lag: int = 0,
        error: GatewayError | None = None,
    ) -> FoldedTurn:
        """All or nothing: the fold is planned (every check) and the caller's answer serialized before the session
        changes, so a failure at any step leaves it byte-identical and servable."""
        model_turn = trajectory.sample.plan_model_turn(
            turn, routing_start_len=plan.routing_start_len, routing_lag=routing_lag
        )
        model_turn.record.resumed = resumed
        summary = turn_summary(trajectory, plan, model_turn, resumed=resumed)
        if error is not None:
            summary["interrupted"] = error.to_body()["error"]
        try:
            orjson.dumps(summary)
        except (TypeError, orjson.JSONEncodeError) as exc:  # the codec bounds every field; this is the last line
            raise UpstreamProtocolError(f"the upstream answer cannot be stored: {exc}") from None
        with self.store.growing(trajectory, turn.num_tokens):  # refused past max_session_tokens; keeps the byte count
            trajectory.sample.apply_model_turn(model_turn)
        trajectory.branch.touch()
        self.metrics.turns.labels("model", "partial" if partial else (turn.finish_type or "none")).inc()
        self.metrics.folded_tokens.labels("true").inc(turn.num_tokens)
        if error is not None:
            self.metrics.turns_interrupted.labels(str(error.details.get("reason", error.error_type))).inc()
        log.debug("session %s: +%d tokens (%s)", trajectory.session_id, turn.num_tokens, turn.finish_type)
        return FoldedTurn(summary, model_turn, tuple(trajectory.sample.weight_version_table), resumed, error)

    def abort_all(self, reason: str) -> list[RunningTurn]:
        """Abort every turn running in this process, at once (``abort_running_turns`` without the wait)."""
        running = self.store.running_turns()
        for turn in running:
            turn.abort(reason)
        return running

    async def abort_running_turns(self, reason: str, timeout_s: float = 4.0) -> None:
        """End every turn running in this process, never resumed: each one folds what it has (aborted, coherent) and
        its caller is told it was aborted (chat: 503 turn_aborted). Shutdown, the gateway-wide abort
        (``/abort_request`` with ``abort_all``) and, across replicas, whatever relays that abort call this; it returns
        once they have ended (or after ``timeout_s``)."""
        await abort_turns(self.store.running_turns(), reason, timeout_s)


async def abort_turns(turns: Sequence[RunningTurn], reason: str, timeout_s: float = ABORT_SETTLE_S) -> bool:
    """Abort ``turns`` (each folds what it has, marked aborted) and wait up to ``timeout_s`` for them to end;
    whether every one did."""
    for turn in turns:
        turn.abort(reason)
    return all(await asyncio.gather(*(turn.wait(timeout_s) for turn in turns)))


def check_answer_belongs(submission: Submission, turn: DecodedTurn) -> None:
    """An answer is folded only into the turn that asked for it: a late or foreign answer (an earlier request's,
    on a reused connection) would otherwise become this turn's tokens."""
    if turn.rid != submission.rid:
        raise UpstreamProtocolError(
            f"the upstream answered for request {turn.rid!r}, not for this turn's {submission.rid!r}",
            reason="foreign_answer",
        )


class _Stopped(Exception):
    """The turn was aborted on this side between two of its requests: nothing more is sent."""


class Turn:
    """A model turn in flight on a branch, as the abort endpoint and shutdown see it (``store.RunningTurn``), and
    the part of its state machine both shapes share: the requests so far and their answers (``draft``), the
    decision to resume after an answer, the resuming request's submission, and the fold."""

    mode = "unary"  # the metrics' label

    def __init__(self, runner: TurnRunner, trajectory: Trajectory, plan: TurnPlan) -> None:
        self.runner = runner
        self.trajectory = trajectory
        self.plan = plan
        self.rid = plan.rid
        self.abort_reason: str | None = None
        self.draft = TurnDraft(
            plan.rid,
            plan.prompt_length,
            plan.routing_start_len,
            plan.sampling_params,
            trajectory.sample.moe if plan.want_routing else None,
            runner.incremental_routing,
        )
        self.submission = self.draft.first()
        self.deadline = asyncio.get_running_loop().time() + runner.deadline_s
        self.interruption: GatewayError | None = None  # why an engine abort was not resumed
        self._done = asyncio.Event()
        self._aborted = asyncio.Event()
        self._abort_task: asyncio.Task[None] | None = None
        trajectory.running = self

    # ---- abort -------------------------------------------------------------------------------------------------
    def abort(self, reason: str) -> None:
        if self.abort_reason is not None or self._done.is_set():
            return
        self.abort_reason = reason
        self._aborted.set()
        self._abort_task = asyncio.create_task(self._abort_upstream(), name=f"abort-{self.rid}")

    async def _abort_upstream(self) -> None:
        # SGLang answers an aborted rid with its partial tokens and replay data; through a router (no abort
        # route) closing the connection is what aborts it.
        await self.runner.upstream.abort_request(self.submission.rid)

    async def wait(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._done.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def finished(self) -> None:
        self._done.set()

    # ---- resume --------------------------------------------------------------------------------------------------
    def resumes_after(self, answer: DecodedTurn) -> bool:
        """Whether the turn goes on after ``answer``: an engine abort that nobody on this side asked for, within the
        bounds (``GATEWAY_RESUME_MAX``, the deadline, the session's room). If so the answer is kept and the next
        request planned; if not, ``interruption`` says why an engine abort ends the turn."""
        if not engine_abort(answer) or self.abort_reason is not None:
            return False
        resumed, runner = self.draft.resumed, self.runner
        reason = None
        if not self.plan.resume:
            reason = "off", "resuming is off for this turn"
        elif resumed >= runner.resume_max:
            reason = "resume_max", f"it was resumed {resumed} times already (GATEWAY_RESUME_MAX={runner.resume_max})"
        elif self.time_left() < RESUME_MIN_TIME_S:
            reason = "deadline", f"the turn's deadline (GATEWAY_REQUEST_TIMEOUT_S={runner.deadline_s:g}) is near"
        elif not self._room_for(self.draft.num_tokens + answer.num_tokens + 1):
            reason = "max_session_tokens", "the session has no room for more tokens (GATEWAY_MAX_SESSION_TOKENS)"
        if reason is not None:
            self.interruption = TurnInterrupted(
                f"the engine aborted the turn after {self.draft.num_tokens + answer.num_tokens} tokens "
                f"({(answer.finish_reason or {}).get('message', 'abort')}) and it was not resumed: {reason[1]}",
                reason=reason[0],
                resumed=resumed,
            )
            return False
        self.draft.add(answer)
        self.submission = self.draft.next()
        runner.metrics.turn_resumes.labels(self.mode).inc()
        runner.metrics.resumed_tokens.inc(answer.num_tokens)
        log.info(
            "session %s: the engine aborted turn %s after %d tokens (%s): resumed as %s",
            self.trajectory.session_id,
            self.rid,
            self.draft.num_tokens,
            (answer.finish_reason or {}).get("message"),
            self.submission.rid,
        )
        return True

    def time_left(self) -> float:
        return self.deadline - asyncio.get_running_loop().time()

    def _room_for(self, tokens: int) -> bool:
        try:
            self.runner.store.check_room(self.trajectory, tokens)
        except LimitExceeded:
            return False
        return True

    async def resubmit(self, send: Callable[[bytes, float], Awaitable[T]], *, stream: bool) -> T:
        """Send the resuming request (``submission``). SGLang holds a request while it is paused, so it goes at once;
        one the upstream refuses instead (unreachable, 503: a router whose worker is out for the update, an engine
        that does not hold requests) is sent again after a pause, until the turn's deadline. ``_Stopped`` when the
        turn is aborted meanwhile; ``TurnInterrupted`` when the deadline passes."""
        delay = RESUME_RETRY_FIRST_S
        payload = upstream_payload(self.trajectory, self.plan, self.submission, stream=stream)
        while True:
            if self.abort_reason is not None:
                raise _Stopped()
            try:
                return await send(payload, max(0.001, self.time_left()))
            except UpstreamUnavailable as exc:
                if self.time_left() <= delay:
                    raise TurnInterrupted(
                        f"the engine aborted the turn and refused to take it back until its deadline: {exc.message}",
                        reason="refused",
                        resumed=self.draft.resumed,
                    ) from exc
                log.info(
                    "session %s: %s refused (%s); again in %.2fs", self.trajectory.session_id, self.rid, exc, delay
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._aborted.wait(), delay)
            delay = min(2 * delay, RESUME_RETRY_MAX_S)

    def decode(self, answer: AnswerBytes) -> DecodedTurn:
        """An answer (a unary one, a stream's final chunk) decoded for what this turn asked for."""
        return decode_generate_response(answer, want_routing=self.plan.want_routing, want_top_p=self.plan.want_top_p)

    # ---- the end ---------------------------------------------------------------------------------------------------
    def ending_error(self, turn: DecodedTurn) -> GatewayError | None:
        """For a chat client: why this turn, ending with ``turn``'s finish, is not the model's answer."""
        if turn.finish_type != "abort":
            return None
        if self.abort_reason is not None:
            return TurnAborted(
                f"the turn was aborted ({self.abort_reason}) after {turn.num_tokens} tokens; the session keeps them",
                reason="aborted",
                resumed=self.draft.resumed,
            )
        status = (turn.finish_reason or {}).get("status_code")
        if isinstance(status, int) and 400 <= status < 500:
            message = (turn.finish_reason or {}).get("message", "aborted")
            return UpstreamRejected(f"the engine refused the request: {message}", upstream_status=status)
        return self.interruption or TurnInterrupted(
            f"the engine aborted the turn: {(turn.finish_reason or {}).get('message', 'abort')}",
            reason="engine_abort",
            resumed=self.draft.resumed,
        )

    def interrupted_by(self, error: GatewayError) -> None:
        """The turn ends with ``error`` instead of its last answer: what its caller is told of it (``ending_error``),
        the error itself when it says why the turn was not resumed, else, once an answer was kept, the resumption
        that failed."""
        if isinstance(error, TurnInterrupted):
            self.interruption = error
        elif self.draft.answers:
            self.interruption = _resume_failed(error, self.draft.resumed)

    def fold_final(self, answer: DecodedTurn) -> FoldedTurn:
        """The turn's last answer came: fold it with the answers kept before it, as one turn."""
        return self._fold(answer, partial=False)

    def fold_kept(self, reason: str, current: DecodedTurn | None = None) -> FoldedTurn:
        """The turn ended without its last answer (aborted on this side, cut, failed): fold the answers kept and
        ``current`` (what the running request brought, if anything), as an aborted turn."""
        return self._fold(aborted_turn(self.submission.rid, reason) if current is None else current, partial=True)

    def _fold(self, last: DecodedTurn, *, partial: bool) -> FoldedTurn:
        turn, routing_lag = self.draft.combined(last)
        return self.runner.fold(
            self.trajectory,
            self.plan,
            turn,
            partial=partial,
            resumed=self.draft.resumed,
            routing_lag=routing_lag,
            error=self.ending_error(turn),
        )


class UnaryTurn(Turn):
    """A unary turn: each of its requests runs in a task of its own, so that an abort can cut it."""

    mode = "unary"

    def __init__(self, runner: TurnRunner, trajectory: Trajectory, plan: TurnPlan) -> None:
        super().__init__(runner, trajectory, plan)
        body = upstream_payload(trajectory, plan)
        self.call: asyncio.Task[Body] = asyncio.create_task(
            runner.upstream.post_generate(body, routing_key=trajectory.session_id), name=f"generate-{plan.rid}"
        )

    async def run(self) -> FoldedTurn:
        try:
            while True:
                answer = await self.answer()
                if answer is None:  # aborted before this request answered: what the turn had, aborted
                    return self.fold_kept(self.abort_reason or "aborted")
                turn = await self._decoded(answer)
                if not self.resumes_after(turn):
                    return self.fold_final(turn)
                self.call = asyncio.create_task(self._resubmitted(), name=f"generate-{self.submission.rid}")
        except GatewayError as error:
            if not self.draft.answers:
                raise  # the first request failed: nothing changed, a plain error for the caller
            # A resumption failed: the answers kept are the turn (aborted, the error said), not thrown away.
            self.runner.metrics.record_error(error)
            self.interrupted_by(error)
            return self.fold_kept(f"resuming failed: {error.message}")
        finally:
            self.call.cancel()  # a no-op once it is done; else the caller went away and the connection must close
            self.finished()

    async def _resubmitted(self) -> Body:
        try:
            return await self.resubmit(self._post, stream=False)
        except _Stopped:
            raise asyncio.CancelledError() from None  # as if the abort had cut the call

    async def _post(self, payload: bytes, timeout_s: float) -> Body:
        return await self.runner.upstream.post_generate(
            payload, routing_key=self.trajectory.session_id, timeout_s=timeout_s
        )

    async def _decoded(self, answer: Body) -> DecodedTurn:
        try:
            turn = await self.runner.cpu.decode("answer", len(answer), lambda: self.decode(answer))
        finally:
            self.runner.upstream.recycle(answer)  # the decoded turn holds no view of the answer's bytes
        check_answer_belongs(self.submission, turn)
        return turn

    async def _abort_upstream(self) -> None:
        # A worker ends an aborted rid itself, answering with its partial tokens and replay data. A router has no
        # abort route: there (or if the worker does not end it in time) closing the connection is what aborts it.
        if await self.runner.upstream.abort_request(self.submission.rid) and await self.wait(ABORT_GRACE_S):
            return
        self.call.cancel()

    async def answer(self) -> Body | None:
        """The running request's answer, or None when an abort cut the call before it came."""
        try:
            return await self.call
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self.abort_reason is None or (current is not None and current.cancelling()):
                raise  # not our abort: the caller's request itself is being cancelled
            return None


def _resume_failed(error: GatewayError, resumed: int) -> TurnInterrupted:
    return TurnInterrupted(
        f"the engine aborted the turn and resuming it failed: {error.message}",
        reason="resume_failed",
        resumed=resumed,
        cause=error.error_type,
    )


def aborted_turn(rid: str, reason: str, **received: Any) -> DecodedTurn:
    """A turn that an abort ended with what had arrived (``received``: token ids, log-probs, text, top-p spans,
    weight version spans)."""
    received.setdefault("token_ids", np.empty(0, np.int32))
    received.setdefault("log_probs", np.empty(0, np.float32))
    received.setdefault("text", "")
    return DecodedTurn(finish_reason={"type": "abort", "message": reason}, rid=rid, **received)


# Called once a streamed turn has ended, with the session still held: the folded turn (whole or partial), or None
# when nothing was folded (the session is as before the turn).
TurnEndHook = Callable[["FoldedTurn | None"], None]


class StreamTurn(Turn):
    """A streamed turn: a producer task folds the upstream stream (the streams, when the turn is resumed: their
    deltas go on as one); the caller reads events from a queue."""

    mode = "stream"

    def __init__(
        self,
        runner: TurnRunner,
        trajectory: Trajectory,
        plan: TurnPlan,
        response: Response,
        *,
        on_end: TurnEndHook | None = None,
    ) -> None:
        super().__init__(runner, trajectory, plan)
        self._on_end = on_end
        self.token_ids = GrowableArray(np.int32)  # every token the caller was sent, across the turn's requests
        self.log_probs = GrowableArray(np.float32)
        self.text_parts: list[str] = []
        self.events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._open(response)
        self.task = asyncio.create_task(self._produce(), name=f"stream-{self.rid}")

    def _open(self, response: Response) -> None:
        """Read ``response``, the stream of the running request (the turn's first, or a resumption)."""
        self._next_request()
        self.response = response
        self._pieces = self.runner.upstream.relay(response)  # the upstream body; closing it closes the response

    def _next_request(self) -> None:
        """From here the caller's tokens are the next request's: the ones before are the answers kept (a cut from
        now on folds them once, and what the new request brought)."""
        self.decoder = CumulativeStreamDecoder()
        self._owner_checked = False  # whether the first non-final chunk's rid was checked (``_check_owner``)
        self._request_start = len(self.token_ids)  # the caller's tokens before this request's
        self._text_start = len(self.text_parts)

    async def client_events(self) -> AsyncIterator[bytes]:
        """The caller's SSE: deltas, then a ``turn`` (or ``error``) event, then ``[DONE]``."""
        async for batch, ended in self.event_batches():
            yield b"".join(b"data: %b\n\n" % orjson.dumps(event) for event in batch) + (
                b"data: [DONE]\n\n" if ended else b""
            )

    async def event_batches(self) -> AsyncIterator[tuple[list[dict[str, Any]], bool]]:
        """The turn's events as they come: ``delta``s, then one ``turn`` (or ``error``) event. Whatever is queued
        comes in one batch (for one write: each write to a loopback peer costs a trip through its TCP stack, more
        than the bytes of a delta); ``ended`` is true on the last batch. A caller that stops reading before the end
        (it went away) aborts the turn."""
        try:
            ended = False
            while not ended:
                batch = [await self.events.get()]
                while not self.events.empty():
                    batch.append(self.events.get_nowait())
                ended = batch[-1] is None
                yield [event for event in batch if event is not None], ended
        finally:
            if not self.task.done():  # the caller went away mid-turn
                self.abort("client disconnected")

    async def _abort_upstream(self) -> None:
        await super()._abort_upstream()
        if await self.wait(ABORT_GRACE_S):
            return
        log.info(
            "session %s: upstream did not end rid %s in %.1fs; closing it",
            self.trajectory.session_id,
            self.submission.rid,
            ABORT_GRACE_S,
        )
        self.task.cancel()

    async def _produce(self) -> None:
        folded: FoldedTurn | None = None
        complete = False  # the upstream sent its final chunk: only [DONE] remains to read
        final: dict[str, Any] | None = None  # the caller's last event, sent once the session has kept the turn
        try:
            folded = await self._consume_turn()
            complete = True
            final = {"type": "turn", **folded.summary}
        except (asyncio.CancelledError, _Stopped):
            folded = self._fold_partial(self.abort_reason or "gateway shutdown")
            final = {"type": "turn", **folded.summary}
            if self.abort_reason is None:
                raise  # not our own hard stop: shutdown
        except (UpstreamProtocolError, LimitExceeded) as exc:
            # An invalid or over-limit answer changes nothing, exactly as in a unary turn; a resumed turn keeps the
            # answers before it.
            self.runner.metrics.record_error(exc)
            folded = self._fold_failed(exc) if self.draft.answers else None
            final = {
                "type": "error",
                "error": exc.to_body()["error"],
                "turn": None if folded is None else folded.summary,
            }
        except GatewayError as error:
            self.runner.metrics.record_error(error)
            self.interrupted_by(error)
            folded = self._fold_partial(error.message) if len(self.token_ids) or self.draft.answers else None
            turn = None if folded is None else folded.summary
            final = {"type": "error", "error": error.to_body()["error"], "turn": turn}
        except Exception:  # a bug: the caller still gets an error event, and the session is released
            log.exception("session %s: streamed turn %s failed", self.trajectory.session_id, self.rid)
            error = GatewayError("internal error while streaming the turn (see the gateway log)")
            final = {"type": "error", "error": error.to_body()["error"], "turn": None}
        finally:
            self._ended(folded)
            try:
                await self.runner.store.release(self.trajectory)
            except GatewayError as error:  # the store could not keep the turn (a shared backend down)
                self.runner.metrics.record_error(error)
                final = {"type": "error", "error": error.to_body()["error"], "turn": None}
            self.finished()
            if final is not None:
                self.events.put_nowait(final)
            self.events.put_nowait(None)
            try:
                if complete:
                    await self._read_rest()
            finally:
                await self._close()

    async def _consume_turn(self) -> FoldedTurn:
        """The requests of the turn, one after the other, until one's answer is the turn's last; then the fold."""
        while True:
            answer = await self._consume()
            if not self.resumes_after(answer):
                return self.fold_final(answer)
            self._next_request()  # the answer is kept: what streamed of it is no longer the running request's
            await self._read_rest()
            await self._close()
            self._open(await self.resubmit(self._open_stream, stream=True))

    async def _open_stream(self, payload: bytes, timeout_s: float) -> Response:
        return await self.runner.upstream.open_generate_stream(
            payload, routing_key=self.trajectory.session_id, timeout_s=timeout_s
        )

    async def _close(self) -> None:
        await self._pieces.aclose()
        await self.response.aclose()

    def _ended(self, folded: FoldedTurn | None) -> None:
        if self._on_end is None:
            return
        try:
            self._on_end(folded)
        except Exception:  # the hook's owner reports its own errors; the session must still be released
            log.exception("session %s: the end of streamed turn %s failed", self.trajectory.session_id, self.rid)

    async def _read_rest(self) -> None:
        """After the final chunk only ``[DONE]`` and the end of the body remain: read them, so that the connection
        goes back to the pool rather than being closed (a new connection per streamed turn piles up sockets in
        TIME_WAIT). An upstream that does not end the body soon is cut: the turn is folded already."""
        with contextlib.suppress(TimeoutError, GatewayError):
            async with asyncio.timeout(STREAM_TAIL_S):
                async for _ in self._pieces:
                    pass

    async def _consume(self) -> DecodedTurn:
        """The running request's stream, its deltas sent on to the caller; its final answer, decoded."""
        upstream = self.runner.upstream
        # The final event (tens of MB of routing) is joined into a pooled buffer, given back once decoded.
        events = SSEDecoder(big_buffer=upstream.buffers.take)
        async for piece in self._pieces:
            try:
                payloads = [event.data for event in events.feed(piece)]
            except SSEError as exc:
                raise UpstreamProtocolError(f"unreadable upstream stream: {exc}") from exc
            for payload in payloads:
                if payload == SSE_DONE:
                    break
                try:
                    answer = await self._on_chunk(payload)
                finally:
                    upstream.recycle(payload)
                if answer is not None:
                    return answer
        raise UpstreamError("upstream stream ended without a final chunk")

    async def _on_chunk(self, payload: bytes) -> DecodedTurn | None:
        if self.decoder.is_final(payload):
            turn = await self.runner.cpu.decode("stream_final", len(payload), lambda: self.decode(payload))
            check_answer_belongs(self.submission, turn)
            self._take(self.decoder.final_delta(turn))
            return turn
        work = self.decoder.work_bytes(payload)
        delta, answer = await self.runner.cpu.decode("stream_chunk", work, lambda: self.decoder.feed(payload))
        if answer is not None and (error := stream_error_payload(answer)) is not None:
            raise UpstreamError(
                f"upstream reported an error in the stream: {error.get('message', error)}",
                upstream_code=error.get("code"),
            )
        if not self._owner_checked:
            self._check_owner(payload, answer)
        self._take(delta)
        meta = None if answer is None else answer.get("meta_info")
        if not isinstance(meta, dict) or meta.get("finish_reason") is None:
            return None
        # a final chunk the fast check could not see (its keys laid out differently): decode the parsed form
        turn = decode_answer(answer, want_routing=self.plan.want_routing, want_top_p=self.plan.want_top_p)  # type: ignore[arg-type]
        check_answer_belongs(self.submission, turn)
        return turn

    def _check_owner(self, payload: AnswerBytes, answer: dict[str, Any] | None) -> None:
        """The first chunk says whose stream this is. Without this check a foreign stream (a late answer on a reused
        connection) reached the caller as deltas until its final chunk was refused, and one cut before its final
        chunk (upstream death, abort) was folded as this turn's partial tokens. One full parse of one small chunk
        (the big replay arrays come in the final chunk, checked by ``check_answer_belongs``)."""
        self._owner_checked = True
        rid = answer_rid(answer, payload)
        if rid is not None and rid != self.submission.rid:
            raise UpstreamProtocolError(
                f"the upstream streamed for request {rid!r}, not for this turn's {self.submission.rid!r}",
                reason="foreign_answer",
            )

    def _take(self, delta: StreamDelta) -> None:
        if not len(delta.token_ids) and not delta.text:
            return
        # Past max_session_tokens the stream is cut here (LimitExceeded): no fold, partial or not, could take it.
        self.runner.store.check_room(self.trajectory, len(self.token_ids) + len(delta.token_ids))
        self.token_ids.append(delta.token_ids)
        self.log_probs.append(delta.log_probs)
        self.text_parts.append(delta.text)
        self.events.put_nowait(
            {
                "type": "delta",
                "token_ids": delta.token_ids.tolist(),
                "text": delta.text,
                "completion_tokens": len(self.token_ids),
            }
        )

    def _fold_partial(self, reason: str) -> FoldedTurn:
        """Fold every token received so far as an aborted turn: the answers kept, and what the running request
        streamed before it was cut.

        The upstream never sent the running request's replay data: its tokens get empty top-p spans (when top-p
        replay is on, so the session keeps it) and no routing rows (the next turn's ``routed_experts_start_len``
        asks for them, as after tool tokens). Nor its ``weight_versions`` spans: each chunk's tokens get that
        chunk's ``weight_version`` (unknown, -1, without one), and no entry is added to slime's per-turn
        ``weight_versions`` (as before: there is no final ``weight_version``).
        """
        start = self._request_start
        n = len(self.token_ids) - start
        no_spans = (np.empty(0, np.int32), np.zeros(n + 1, np.int32)) if self.plan.want_top_p else (None, None)
        current = aborted_turn(
            self.submission.rid,
            reason,
            token_ids=self.token_ids.view()[start:],
            log_probs=self.log_probs.view()[start:],
            text="".join(self.text_parts[self._text_start :]),
            top_p_ids=no_spans[0],
            top_p_offsets=no_spans[1],
            weight_version_spans=self.decoder.partial_version_spans(n),
        )
        return self.fold_kept(reason, current)

    def _fold_failed(self, error: GatewayError) -> FoldedTurn:
        """A resumption's answer could not be used: the answers kept before it are the turn (aborted)."""
        self.interrupted_by(error)
        return self.fold_kept(f"resuming failed: {error.message}")
