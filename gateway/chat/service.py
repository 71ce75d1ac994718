"""A chat turn on a session, all or nothing: plan the new tokens, add them, run the model turn, parse the reply.

Both chat APIs (``gateway.chat.openai``, ``gateway.chat.anthropic``) run their turns through ``ChatService``: the
same token-level turn as ``POST /v1/sessions/{id}/generate`` (``gateway.turns``), with routing and top-p replay
exactly as there, preceded by the request's new messages as non-trainable tokens. A failure at any step (the
template, a limit, the upstream, an invalid answer) leaves the session as it was: the added tokens (or the new
branch) are undone.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from gateway.chat.conversation import ChatPlan, DriftPolicy, apply_plan, plan_chat, record_reply
from gateway.chat.messages import AssistantReply, ChatMessage, ChatRequest
from gateway.chat.template import ChatTemplate
from gateway.chat.tool_parsers import PARSERS, STREAM_SPLITTERS, HermesStreamSplitter, ParsedCompletion
from gateway.errors import ContextLengthExceeded, GatewayError
from gateway.schemas import TurnCreate
from gateway.state import GatewayState
from gateway.store import Session
from gateway.turns import FoldedTurn, StreamTurn, open_stream_turn, run_turn

log = logging.getLogger("gateway.chat")

FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass(frozen=True, slots=True)
class ChatResult:
    session_id: str
    branch: int  # which trajectory of the session this turn is on (0 until a history is edited)
    reply: AssistantReply
    folded: FoldedTurn
    render_s: float

    def gateway_json(self) -> dict[str, Any]:
        """Beside each API's own fields (clients ignore it): where the turn landed in the session."""
        summary = self.folded.summary
        return {
            "session_id": self.session_id,
            "branch": self.branch,
            "turn": summary["turn"],
            "status": summary["status"],
            "total_tokens": summary["total_tokens"],
            "routed_experts_rows": summary["routed_experts_rows"],
            "finish_reason": self.folded.plan.turn.finish_reason,
            "render_ms": round(self.render_s * 1e3, 3),
        }


class ChatService:
    """The chat side of one gateway: the tokenizer and template, the tool-call parser, the drift policy."""

    def __init__(
        self,
        template: ChatTemplate,
        *,
        tool_parser: str = "hermes",
        drift_policy: DriftPolicy = "fork",
        context_tokens: int | None = None,
    ) -> None:
        if tool_parser not in PARSERS:
            raise ValueError(f"unknown tool parser {tool_parser!r}; known: {', '.join(sorted(PARSERS))}")
        self.template = template
        self.tool_parser = tool_parser
        self.drift_policy: DriftPolicy = drift_policy
        self.context_tokens = context_tokens

    # ---- one turn ---------------------------------------------------------------------------------------------
    async def run(self, state: GatewayState, session_id: str, request: ChatRequest) -> ChatResult:
        async with state.store.exclusive(session_id) as session:
            plan = await self._plan(state, session, request)
            undo = self._begin(state, session, request, plan)
            try:
                folded = await run_turn(state, session, _turn_request(request))
            except BaseException:
                undo()
                raise
            return self._finish(state, session, request, plan, folded)

    async def open_stream(self, state: GatewayState, session_id: str, request: ChatRequest) -> ChatStream:
        """Start a streamed turn; errors before the upstream answers are plain errors (the session unchanged)."""
        session = await state.store.acquire(session_id)
        try:
            plan = await self._plan(state, session, request)
            undo = self._begin(state, session, request, plan)
            stream = ChatStream(self, state, session, request, plan, undo)
            try:
                stream.turn = await open_stream_turn(state, session, _turn_request(request), on_end=stream.ended)
            except BaseException:
                undo()
                raise
        except BaseException:
            await state.store.release(session)
            raise
        return stream

    async def _plan(self, state: GatewayState, session: Session, request: ChatRequest) -> ChatPlan:
        # The template renders the whole history (twice, for a continuation): off the loop when it is long.
        size = sum(len(m.content) + sum(len(c.arguments) for c in m.tool_calls) for m in request.messages)
        plan = await state.run_cpu(size, lambda: plan_chat(self.template, session, request, self.drift_policy))
        self._check_context(plan.tokens_after(session), request)
        return plan

    def _begin(self, state: GatewayState, session: Session, request: ChatRequest, plan: ChatPlan) -> Callable[[], None]:
        if plan.first_difference is not None:
            state.metrics.chat_drift.labels(self.drift_policy).inc()
            log.info(
                "session %s: chat history differs from message %d on; new branch from token %d",
                session.session_id,
                plan.first_difference,
                plan.fork_at,
            )
        undo = apply_plan(state.store, session, plan)
        try:
            state.store.check_growth(session)  # room for the answer: the limits, with the new tokens counted
        except BaseException:
            undo()
            raise
        return undo

    def _finish(
        self, state: GatewayState, session: Session, request: ChatRequest, plan: ChatPlan, folded: FoldedTurn
    ) -> ChatResult:
        """Parse the reply and record it; cannot fail on the answer's content (malformed calls stay content)."""
        reply = self.reply(request, folded, self.parse(request, folded.plan.turn.text))
        record_reply(session, request, plan, reply.message)
        state.metrics.chat_turns.labels("stream" if request.stream else "unary", reply.finish).inc()
        return ChatResult(session.session_id, len(session.branches), reply, folded, plan.delta.render_s)

    # ---- parts ------------------------------------------------------------------------------------------------
    def parse(self, request: ChatRequest, text: str) -> ParsedCompletion:
        if not request.parse_tool_calls:
            return ParsedCompletion(text, ())
        return PARSERS[self.tool_parser](text)

    def splitter(self, request: ChatRequest) -> HermesStreamSplitter | None:
        return STREAM_SPLITTERS[self.tool_parser]() if request.parse_tool_calls else None

    @staticmethod
    def reply(request: ChatRequest, folded: FoldedTurn, parsed: ParsedCompletion) -> AssistantReply:
        turn, summary = folded.plan.turn, folded.summary
        finish = FINISH.get(turn.finish_type or "", "stop")
        if finish == "stop" and parsed.tool_calls:
            finish = "tool_calls"
        return AssistantReply(
            message=ChatMessage("assistant", parsed.content, parsed.tool_calls),
            finish=finish,  # type: ignore[arg-type]
            completion_tokens=turn.num_tokens,
            prompt_tokens=int(summary["prompt_length"]),
            cached_tokens=turn.cached_tokens,
            rid=str(summary["rid"]),
        )

    def _check_context(self, prompt_tokens: int, request: ChatRequest) -> None:
        limit = self.context_tokens
        if limit is None:
            return
        wanted = request.sampling_params.get("max_new_tokens")
        total = prompt_tokens + (wanted if isinstance(wanted, int) else 1)
        if total > limit:
            raise ContextLengthExceeded(
                f"this model's context is {limit} tokens; the conversation holds {prompt_tokens} and "
                f"{wanted if isinstance(wanted, int) else 'at least 1'} more were asked for",
                context_tokens=limit,
                prompt_tokens=prompt_tokens,
            )


def _turn_request(request: ChatRequest) -> TurnCreate:
    return TurnCreate.model_validate({"sampling_params": request.sampling_params, "stream": request.stream})


@dataclass
class StreamEvent:
    """What the API adapters turn into their own events: content text, then one end."""

    text: str = ""
    end: bool = False
    reply: AssistantReply | None = None  # the end of a turn that was folded (whole, or partial)
    error: dict[str, Any] | None = None  # the end of a failed turn: the gateway's error body
    branch: int = 0


@dataclass
class ChatStream:
    service: ChatService
    state: GatewayState
    session: Session
    request: ChatRequest
    plan: ChatPlan
    undo: Callable[[], None]
    turn: StreamTurn | None = None
    result: ChatResult | None = None
    _splitter: HermesStreamSplitter | None = field(default=None, init=False)

    def ended(self, folded: FoldedTurn | None) -> None:
        """``StreamTurn``'s end hook, with the session still held: record the reply, or undo the new tokens."""
        if folded is None:
            self.undo()
            return
        self.result = self.service._finish(self.state, self.session, self.request, self.plan, folded)

    async def events(self) -> AsyncIterator[StreamEvent]:
        assert self.turn is not None
        self._splitter = self.service.splitter(self.request)
        error: dict[str, Any] | None = None
        async with aclosing(self.turn.event_batches()) as batches:
            async for batch, ended in batches:
                text = "".join(self._content(event) for event in batch)
                for event in batch:
                    if event["type"] == "error":
                        error = event["error"]
                if text:
                    yield StreamEvent(text=text)
                if ended:
                    yield self._end(error)

    def _content(self, event: dict[str, Any]) -> str:
        if event["type"] != "delta" or not event["text"]:
            return ""
        return event["text"] if self._splitter is None else self._splitter.feed(event["text"])

    def _end(self, error: dict[str, Any] | None) -> StreamEvent:
        result = self.result
        if result is None:  # nothing folded: the session is as before the request
            fallback = GatewayError("the turn ended without an answer").to_body()["error"]
            return StreamEvent(end=True, error=error or fallback)
        rest = ""
        if self._splitter is not None:
            message = result.reply.message
            rest = self._splitter.finish(ParsedCompletion(message.content, message.tool_calls))
        return StreamEvent(text=rest, end=True, reply=result.reply, error=error, branch=result.branch)
