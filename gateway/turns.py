"""One model turn of a session: build the SGLang request, call upstream, decode off-loop, fold.

Two shapes share the planning and the fold: a unary turn (one JSON answer) and a streamed turn (SGLang's
cumulative SSE, turned into deltas for the caller). A streamed turn runs in its own task, independent of
the caller's connection, so an abort, a cut client or a dying upstream always ends in a coherent session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

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
from gateway.errors import GatewayError, LimitExceeded, SessionConflict, UpstreamError, UpstreamProtocolError
from gateway.metrics import GatewayMetrics
from gateway.offload import CpuPool
from gateway.sample import ModelTurnPlan
from gateway.schemas import TurnCreate
from gateway.store import RunningTurn, SessionStore, Trajectory
from gateway.upstream import Upstream
from slime_wire.http1 import Body, Response
from slime_wire.sse import SSEDecoder, SSEError

log = logging.getLogger("gateway.turns")

TOP_P_FLAG = "return_top_p_token_ids"
# After an abort, how long the upstream gets to end the stream itself (with its final chunk and replay data)
# before the gateway closes the connection and folds what it has.
ABORT_GRACE_S = 3.0
# After a stream's final chunk, how long the rest of the body ([DONE], the last chunk of the framing) may take.
STREAM_TAIL_S = 1.0


@dataclass(frozen=True, slots=True)
class TurnPlan:
    """What this turn asks of SGLang, decided from the request and the session before anything is sent."""

    rid: str
    want_routing: bool
    want_top_p: bool
    routing_start_len: int
    sampling_params: dict[str, Any]
    prompt_length: int


def plan_turn(trajectory: Trajectory, request: TurnCreate, *, incremental_routing: bool = True) -> TurnPlan:
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
    )


def upstream_payload(trajectory: Trajectory, plan: TurnPlan, *, stream: bool = False) -> bytes:
    payload: dict[str, Any] = {
        "input_ids": trajectory.sample.tokens.view(),
        "sampling_params": plan.sampling_params,
        "return_logprob": True,
        "rid": plan.rid,
    }
    if plan.want_routing:
        payload["return_routed_experts"] = True
        if plan.routing_start_len:
            payload["routed_experts_start_len"] = plan.routing_start_len
    if stream:
        payload["stream"] = True
    return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)


def turn_summary(trajectory: Trajectory, plan: TurnPlan, model_turn: ModelTurnPlan) -> dict[str, Any]:
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
    }


@dataclass(frozen=True, slots=True)
class FoldedTurn:
    """A turn folded into its session: the caller's summary, and the plan that was applied (its arrays are this
    turn's own tensors, see ``gateway.views.turn_payload``)."""

    summary: dict[str, Any]
    plan: ModelTurnPlan
    version_table: tuple[str, ...]  # the session's weight version table after the fold


class TurnRunner:
    """Runs the model turns of every session: built once by the app lifespan with what a turn uses (the upstream,
    the CPU pool, the store, the metrics) and handed to the token routes and the chat service."""

    def __init__(
        self,
        upstream: Upstream,
        store: SessionStore,
        cpu: CpuPool,
        metrics: GatewayMetrics,
        *,
        incremental_routing: bool = True,
    ) -> None:
        self.upstream = upstream
        self.store = store
        self.cpu = cpu
        self.metrics = metrics
        self.incremental_routing = incremental_routing

    def plan(self, trajectory: Trajectory, request: TurnCreate) -> TurnPlan:
        return plan_turn(trajectory, request, incremental_routing=self.incremental_routing)

    async def run(self, trajectory: Trajectory, request: TurnCreate) -> FoldedTurn:
        """A unary turn; runs with the branch held (see ``SessionStore.exclusive``)."""
        plan = self.plan(trajectory, request)
        handle = UnaryTurn(self, trajectory, plan)
        trajectory.running = handle
        try:
            answer = await handle.answer()
            if answer is None:  # aborted before any answer: an empty aborted turn, so the session says so
                turn = aborted_turn(plan.rid, handle.abort_reason or "aborted")
                return self.fold(trajectory, plan, turn, partial=True)
            try:
                turn = await self.cpu.decode(
                    "answer",
                    len(answer),
                    lambda: decode_generate_response(
                        answer, want_routing=plan.want_routing, want_top_p=plan.want_top_p
                    ),
                )
            finally:
                self.upstream.recycle(answer)  # the decoded turn holds no view of the answer's bytes
            check_answer_belongs(plan, turn)
            return self.fold(trajectory, plan, turn)
        finally:
            handle.call.cancel()  # a no-op once it is done; else the caller went away and the connection must close
            handle.finished()

    async def open_stream(
        self, trajectory: Trajectory, request: TurnCreate, *, on_end: TurnEndHook | None = None
    ) -> StreamTurn:
        """Plan and open the upstream stream; errors before the first byte are plain HTTP errors for the caller."""
        plan = self.plan(trajectory, request)
        response = await self.upstream.open_generate_stream(
            upstream_payload(trajectory, plan, stream=True), routing_key=trajectory.session_id
        )
        return StreamTurn(self, trajectory, plan, response, on_end=on_end)

    def fold(self, trajectory: Trajectory, plan: TurnPlan, turn: DecodedTurn, *, partial: bool = False) -> FoldedTurn:
        """All or nothing: the fold is planned (every check) and the caller's answer serialized before the session
        changes, so a failure at any step leaves it byte-identical and servable."""
        model_turn = trajectory.sample.plan_model_turn(turn, routing_start_len=plan.routing_start_len)
        summary = turn_summary(trajectory, plan, model_turn)
        try:
            orjson.dumps(summary)
        except (TypeError, orjson.JSONEncodeError) as exc:  # the codec bounds every field; this is the last line
            raise UpstreamProtocolError(f"the upstream answer cannot be stored: {exc}") from None
        with self.store.growing(trajectory, turn.num_tokens):  # refused past max_session_tokens; keeps the byte count
            trajectory.sample.apply_model_turn(model_turn)
        trajectory.branch.touch()
        self.metrics.turns.labels("model", "partial" if partial else (turn.finish_type or "none")).inc()
        self.metrics.folded_tokens.labels("true").inc(turn.num_tokens)
        log.debug("session %s: +%d tokens (%s)", trajectory.session_id, turn.num_tokens, turn.finish_type)
        return FoldedTurn(summary, model_turn, tuple(trajectory.sample.weight_version_table))

    def running_turns(self) -> list[RunningTurn]:
        return self.store.running_turns()

    async def abort_running_turns(self, reason: str, timeout_s: float = 4.0) -> None:
        """End every turn running in this process, never resumed: each one folds what it has (aborted, coherent) and
        its caller is told it was aborted. Shutdown, the gateway-wide abort (``/abort_request`` with ``abort_all``)
        and, across replicas, whatever relays that abort call this; it returns once they have ended (or after
        ``timeout_s``)."""
        running = self.running_turns()
        for turn in running:
            turn.abort(reason)
        await asyncio.gather(*(turn.wait(timeout_s) for turn in running))


def check_answer_belongs(plan: TurnPlan, turn: DecodedTurn) -> None:
    """An answer is folded only into the turn that asked for it: a late or foreign answer (an earlier request's,
    on a reused connection) would otherwise become this turn's tokens."""
    if turn.rid != plan.rid:
        raise UpstreamProtocolError(
            f"the upstream answered for request {turn.rid!r}, not for this turn's {plan.rid!r}",
            reason="foreign_answer",
        )


class TurnHandle:
    """The running turn as the abort endpoint sees it (``store.RunningTurn``)."""

    def __init__(self, runner: TurnRunner, plan: TurnPlan) -> None:
        self.runner = runner
        self.plan = plan
        self.rid = plan.rid
        self.abort_reason: str | None = None
        self._done = asyncio.Event()
        self._abort_task: asyncio.Task[None] | None = None

    def abort(self, reason: str) -> None:
        if self.abort_reason is not None or self._done.is_set():
            return
        self.abort_reason = reason
        self._abort_task = asyncio.create_task(self._abort_upstream(), name=f"abort-{self.rid}")

    async def _abort_upstream(self) -> None:
        # SGLang answers an aborted rid with its partial tokens and replay data; through a router (no abort
        # route) closing the connection is what aborts it.
        await self.runner.upstream.abort_request(self.rid)

    async def wait(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._done.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def finished(self) -> None:
        self._done.set()


class UnaryTurn(TurnHandle):
    """A unary turn: its upstream call runs in a task of its own, so that an abort can cut it."""

    def __init__(self, runner: TurnRunner, trajectory: Trajectory, plan: TurnPlan) -> None:
        super().__init__(runner, plan)
        body = upstream_payload(trajectory, plan)
        self.call = asyncio.create_task(
            runner.upstream.post_generate(body, routing_key=trajectory.session_id), name=f"generate-{plan.rid}"
        )

    async def _abort_upstream(self) -> None:
        # A worker ends an aborted rid itself, answering with its partial tokens and replay data. A router has no
        # abort route: there (or if the worker does not end it in time) closing the connection is what aborts it.
        if await self.runner.upstream.abort_request(self.rid) and await self.wait(ABORT_GRACE_S):
            return
        self.call.cancel()

    async def answer(self) -> Body | None:
        """The upstream's answer, or None when an abort cut the call before it came."""
        try:
            return await self.call
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self.abort_reason is None or (current is not None and current.cancelling()):
                raise  # not our abort: the caller's request itself is being cancelled
            return None


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


class StreamTurn(TurnHandle):
    """A streamed turn: a producer task folds the upstream stream; the caller reads events from a queue."""

    def __init__(
        self,
        runner: TurnRunner,
        trajectory: Trajectory,
        plan: TurnPlan,
        response: Response,
        *,
        on_end: TurnEndHook | None = None,
    ) -> None:
        super().__init__(runner, plan)
        self.trajectory = trajectory
        self._on_end = on_end
        self.response = response
        self.decoder = CumulativeStreamDecoder()
        self.token_ids = GrowableArray(np.int32)
        self.log_probs = GrowableArray(np.float32)
        self.text_parts: list[str] = []
        self._owner_checked = False  # whether the first non-final chunk's rid was checked (``_check_owner``)
        self._pieces = runner.upstream.relay(response)  # the upstream body; closing it closes the response
        self.events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        trajectory.running = self
        self.task = asyncio.create_task(self._produce(), name=f"stream-{self.rid}")

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
            self.rid,
            ABORT_GRACE_S,
        )
        self.task.cancel()

    async def _produce(self) -> None:
        folded: FoldedTurn | None = None
        complete = False  # the upstream sent its final chunk: only [DONE] remains to read
        final: dict[str, Any] | None = None  # the caller's last event, sent once the session has kept the turn
        try:
            folded = await self._consume()
            complete = True
            final = {"type": "turn", **folded.summary}
        except asyncio.CancelledError:
            folded = self._fold_partial(self.abort_reason or "gateway shutdown")
            final = {"type": "turn", **folded.summary}
            if self.abort_reason is None:
                raise  # not our own hard stop: shutdown
        except (UpstreamProtocolError, LimitExceeded) as exc:
            # An invalid or over-limit answer changes nothing, exactly as in a unary turn.
            self.runner.metrics.record_error(exc)
            final = {"type": "error", "error": exc.to_body()["error"], "turn": None}
        except GatewayError as error:
            self.runner.metrics.record_error(error)
            folded = self._fold_partial(error.message) if len(self.token_ids) else None
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

    async def _consume(self) -> FoldedTurn:
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
                    folded = await self._on_chunk(payload)
                finally:
                    upstream.recycle(payload)
                if folded is not None:
                    return folded
        raise UpstreamError("upstream stream ended without a final chunk")

    async def _on_chunk(self, payload: bytes) -> FoldedTurn | None:
        if self.decoder.is_final(payload):
            turn = await self.runner.cpu.decode("stream_final", len(payload), lambda: self._decode_final(payload))
            check_answer_belongs(self.plan, turn)
            self._take(self.decoder.final_delta(turn))
            return self.runner.fold(self.trajectory, self.plan, turn)
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
        check_answer_belongs(self.plan, turn)
        return self.runner.fold(self.trajectory, self.plan, turn)

    def _check_owner(self, payload: AnswerBytes, answer: dict[str, Any] | None) -> None:
        """The first chunk says whose stream this is. Without this check a foreign stream (a late answer on a reused
        connection) reached the caller as deltas until its final chunk was refused, and one cut before its final
        chunk (upstream death, abort) was folded as this turn's partial tokens. One full parse of one small chunk
        (the big replay arrays come in the final chunk, checked by ``check_answer_belongs``)."""
        self._owner_checked = True
        rid = answer_rid(answer, payload)
        if rid is not None and rid != self.plan.rid:
            raise UpstreamProtocolError(
                f"the upstream streamed for request {rid!r}, not for this turn's {self.plan.rid!r}",
                reason="foreign_answer",
            )

    def _decode_final(self, payload: bytes) -> DecodedTurn:
        return decode_generate_response(payload, want_routing=self.plan.want_routing, want_top_p=self.plan.want_top_p)

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
        """Fold every token received so far as an aborted turn.

        The upstream never sent this turn's replay data: the tokens get empty top-p spans (when top-p replay
        is on, so the session keeps it) and no routing rows (the next turn's ``routed_experts_start_len``
        asks for them, as after tool tokens). Nor its ``weight_versions`` spans: each chunk's tokens get that
        chunk's ``weight_version`` (unknown, -1, without one), and no entry is added to slime's per-turn
        ``weight_versions`` (as before: there is no final ``weight_version``).
        """
        n = len(self.token_ids)
        no_spans = (np.empty(0, np.int32), np.zeros(n + 1, np.int32)) if self.plan.want_top_p else (None, None)
        turn = aborted_turn(
            self.rid,
            reason,
            token_ids=self.token_ids.view(),
            log_probs=self.log_probs.view(),
            text="".join(self.text_parts),
            top_p_ids=no_spans[0],
            top_p_offsets=no_spans[1],
            weight_version_spans=self.decoder.partial_version_spans(n),
        )
        return self.runner.fold(self.trajectory, self.plan, turn, partial=True)
