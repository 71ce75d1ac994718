"""A chat turn on a session, all or nothing: plan the new tokens, add them, run the model turn, parse the reply.

The three chat APIs (``gateway.chat.openai``, ``gateway.chat.anthropic``, ``gateway.chat.responses``) run their
turns through ``ChatService``: the same token-level turn as ``POST /v1/sessions/{id}/generate`` (``gateway.turns``),
with routing and top-p replay exactly as there, preceded by the request's new messages as non-trainable tokens. A
failure at any step (the template, a limit, the upstream, an invalid answer) leaves the session as it was: the added
tokens (or the new branch) are undone.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from gateway.chat.api import ChatRequestError, HostedTools, check_history
from gateway.chat.conversation import (
    ChatPlan,
    DriftPolicy,
    RewritePolicy,
    apply_plan,
    find_response,
    match_request,
    plan_match,
    record_reply,
    render_size,
)
from gateway.chat.messages import AssistantReply, ChatMessage, ChatRequest, order_tool_results
from gateway.chat.reasoning import ReasoningFormat, ReasoningSplitter, reasoning_format
from gateway.chat.template import ChatTemplate
from gateway.chat.tool_parsers import (
    ParsedCompletion,
    ToolCallFormat,
    ToolCallStreamSplitter,
    pairing_error,
    tool_format,
)
from gateway.errors import (
    ContextLengthExceeded,
    GatewayError,
    PreviousResponseNotFound,
    RequestTooLarge,
    SessionBusy,
    SessionClosed,
    TurnLimitReached,
)
from gateway.schemas import TurnCreate
from gateway.store import Session, Trajectory
from gateway.turns import FoldedTurn, StreamTurn, TurnRunner

log = logging.getLogger("gateway.chat")

FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def _smallest(*limits: int | None) -> int | None:
    known = [limit for limit in limits if limit is not None]
    return min(known) if known else None


# The answer's length when a request names none, the context length unknown and no default configured.
FALLBACK_MAX_TOKENS = 8192


@dataclass(frozen=True, slots=True)
class ChatResult:
    session_id: str
    branch: int  # which trajectory of the session this turn is on (0 until a history is edited)
    reply: AssistantReply
    folded: FoldedTurn
    render_s: float
    request: ChatRequest  # as the turn ran it: resolved (a continued response's history first), its length set

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
            "resumed": self.folded.resumed,  # times the engine aborted it mid-answer and it went on (gateway.resume)
            "render_ms": round(self.render_s * 1e3, 3),
        }


@dataclass(frozen=True, slots=True)
class ChatSettings:
    """How the chat side reads and writes a conversation (``GATEWAY_CHAT_*``)."""

    tool_parser: str = "hermes"
    reasoning_parser: str = "none"
    drift_policy: DriftPolicy = "fork"
    rewrite_policy: RewritePolicy = "append"
    context_tokens: int | None = None
    default_max_tokens: int | None = None  # None: the context left (FALLBACK_MAX_TOKENS when it is unknown)
    max_tools_bytes: int = 1 << 20  # the tools' schemas (their canonical JSON) a request may carry


class ChatService:
    """The chat side of one gateway: the tokenizer and template, the output parsers, the conversation policies; its
    model turns run through the gateway's turn runner (``runner``: its store, CPU pool and metrics are the chat
    side's too)."""

    def __init__(self, template: ChatTemplate, runner: TurnRunner, settings: ChatSettings | None = None) -> None:
        settings = settings or ChatSettings()
        try:
            self.tool_format: ToolCallFormat = tool_format(settings.tool_parser)
            self.reasoning: ReasoningFormat | None = reasoning_format(settings.reasoning_parser)
        except KeyError as exc:
            raise ValueError(exc.args[0]) from None
        mismatch = pairing_error(self.tool_format, self.reasoning)
        if mismatch is not None:
            raise ValueError(mismatch)
        self.template = template
        self.runner = runner
        self.store = runner.store
        self.metrics = runner.metrics
        self.settings = settings
        self.sampling_extra = text_of_special_markers(template, self.tool_format, self.reasoning)
        self.hosted = HostedTools()

    @property
    def context_tokens(self) -> int | None:
        return self.settings.context_tokens

    # ---- one turn ---------------------------------------------------------------------------------------------
    async def run(self, session_id: str, request: ChatRequest) -> ChatResult:
        """One unary turn. A turn that ended before the model ended it (the trainer aborted it, or the engine did and
        it could not be resumed) is kept in the session, recorded, and raised (``FoldedTurn.error``): its client must
        not take the cut reply for an answer."""
        trajectory, request, plan, undo = await self._start(session_id, request)
        try:
            try:
                folded = await self.runner.run(trajectory, _turn_request(request))
            except BaseException:
                undo()
                raise
            result = self._finish(trajectory, request, plan, folded)
        finally:
            await self.store.release(trajectory)
        if folded.error is not None:
            raise folded.error
        return result

    async def open_stream(self, session_id: str, request: ChatRequest) -> ChatStream:
        """Start a streamed turn; errors before the upstream answers are plain errors (the session unchanged)."""
        trajectory, request, plan, undo = await self._start(session_id, request)
        try:
            stream = ChatStream(self, trajectory, request, plan, undo)
            try:
                stream.turn = await self.runner.open_stream(trajectory, _turn_request(request), on_end=stream.ended)
            except BaseException:
                undo()
                raise
        except BaseException:
            await self.store.release(trajectory)
            raise
        return stream  # from here the turn's own task releases the branch, whatever the caller does

    async def _start(
        self, session_id: str, request: ChatRequest
    ) -> tuple[Trajectory, ChatRequest, ChatPlan, Callable[[], None]]:
        """Everything before the model turn: the request resolved and planned against the session's tree, the branch
        it continues (or starts) held, its new tokens added; with the undo of those, for when the turn fails."""
        session = await self.store.get(session_id)
        self._admit(session, holding=False)  # before any rendering
        request = self.resolve(session, request)
        plan = await self._plan(session, request)
        request = self._with_length(session, request, plan.tokens_after())
        trajectory = await self._hold(session, plan, request)
        try:
            self._admit(session, holding=True)  # again, exactly: other requests ran while this one planned
            undo = self._begin(trajectory, plan)
        except BaseException:
            if plan.branch is None:
                self.store.drop_branch(trajectory)
            await self.store.release(trajectory)
            raise
        return trajectory, request, plan, undo

    async def _hold(self, session: Session, plan: ChatPlan, request: ChatRequest) -> Trajectory:
        """Hold the branch the plan continues, or start the one it forks; another turn on that branch is a 409."""
        if plan.branch is None:
            return await self.store.start_branch(session, plan.new_branch(session, request.model))
        trajectory = await self.store.hold(session, plan.branch)
        if plan.branch.record is not plan.record or len(plan.branch.sample.tokens) != plan.fork_at:
            await self.store.release(trajectory)  # another turn changed it while this one was planned
            raise SessionBusy(
                f"branch {trajectory.index} of session {session.session_id!r} changed while this request was "
                "planned; send it again",
                session_id=session.session_id,
                branch=trajectory.index,
            )
        return trajectory

    async def count_tokens(self, session_id: str, request: ChatRequest) -> int:
        """The prompt a turn with this request would give the model, in tokens (nothing changes)."""
        session = await self.store.get(session_id)
        request = self.resolve(session, request)
        plan = await self._plan(session, request, check_context=False)
        return plan.tokens_after()

    # ---- the request, made ready for the conversation logic -------------------------------------------------
    def resolve(self, session: Session, request: ChatRequest) -> ChatRequest:
        """The request as the conversation logic takes it: a continued response's history first, system messages the
        template cannot render where they stand merged into a user message, reasoning a client left inside an
        assistant message's content split out, tool results in the order of their calls; then checked."""
        limit = self.settings.max_tools_bytes
        if len(request.tools_key) > limit:
            raise RequestTooLarge(
                f"the tools' schemas take {len(request.tools_key)} bytes, over the limit of {limit}",
                setting="GATEWAY_CHAT_MAX_TOOLS_BYTES",
                limit=limit,
            )
        if request.previous_response_id is not None:
            request = request.with_history(self._stored_history(session, request))
        messages = request.messages
        if not self.template.renders_system_anywhere:
            messages = merge_late_system_messages(messages)
        if self.reasoning is not None:
            messages = tuple(self._split_history_reasoning(m) for m in messages)
        messages = order_tool_results(messages)
        check_history(messages)
        return replace(request, messages=messages, sampling_params=self.sampling_extra | request.sampling_params)

    def _stored_history(self, session: Session, request: ChatRequest) -> tuple[ChatMessage, ...]:
        history = find_response(session, request.previous_response_id or "")
        if history is None:
            raise PreviousResponseNotFound(
                f"Previous response with id 'resp_{request.previous_response_id}' not found in session "
                f"{session.session_id!r} (a response is kept when it was created with store: true)",
                param="previous_response_id",
            )
        instructions = request.options.get("instructions")
        if instructions is not None:
            # This request's instructions stand in for the earlier ones (they are not carried over, as in the API).
            rest = history[1:] if history and history[0].role == "system" else history
            history = (ChatMessage("system", instructions), *rest)
        return history

    def _split_history_reasoning(self, message: ChatMessage) -> ChatMessage:
        assert self.reasoning is not None
        if message.role != "assistant" or message.reasoning is not None:
            return message
        split = self.reasoning.split_history(message.content)
        if split is None:
            return message
        reasoning, content = split
        return msgspec.structs.replace(message, reasoning=reasoning, content=content)

    async def _plan(self, session: Session, request: ChatRequest, *, check_context: bool = True) -> ChatPlan:
        settings = self.settings
        match = match_request(session, request, settings.drift_policy)  # comparisons only: on the loop
        # The template and the tokenizer: off the loop when what they render is long.
        size = render_size(self.template, match, request, settings.rewrite_policy)
        budget = session.limits.max_context_tokens
        try:
            if check_context:  # a text that cannot fit is refused before seconds of encoding
                fewest = match.tokens_before + self.template.fewest_tokens(size)
                self._check_context(fewest, None, limit=_smallest(self.context_tokens, budget), at_least=True)
            plan = await self.runner.cpu.run(
                size, lambda: plan_match(self.template, match, request, settings.rewrite_policy)
            )
            if check_context:
                prompt = plan.tokens_after()
                self._check_context(prompt, None, limit=budget)  # the session's budget: the prompt alone
                # The model's context: with the length the request asked for, as the session's caps cut it.
                asked = None if request.max_tokens is None else self.answer_length(session, request, prompt)
                self._check_context(prompt, asked, limit=self.context_tokens)
        except ContextLengthExceeded as exc:
            if budget is not None and exc.details["context_tokens"] == budget:
                self.metrics.chat_refused.labels("context_budget").inc()
            raise
        return plan

    def _with_length(self, session: Session, request: ChatRequest, prompt_tokens: int) -> ChatRequest:
        """The request with the answer's length limit it runs with (``answer_length``)."""
        return replace(request, max_tokens=self.answer_length(session, request, prompt_tokens))

    def answer_length(self, session: Session, request: ChatRequest, prompt_tokens: int) -> int:
        """The answer's length limit: the request's own (else the default), cut by the session's caps as slime cuts a
        turn: its ``sampling_defaults.max_new_tokens`` and what is left of its ``max_context_tokens``."""
        length = request.max_tokens if request.max_tokens is not None else self.default_max_tokens(prompt_tokens)
        cap = session.sampling_defaults.get("max_new_tokens")
        budget = session.limits.max_context_tokens
        left = None if budget is None else budget - prompt_tokens
        return min(value for value in (length, cap, left) if value is not None)

    def _admit(self, session: Session, *, holding: bool) -> None:
        """Refuse a turn on a closed session, or past its ``max_turns`` (``holding``: the request holds a branch
        already, so the running turns count it)."""
        try:
            session.check_open()
        except SessionClosed:
            self.metrics.chat_refused.labels("closed").inc()
            raise
        cap = session.limits.max_turns
        if cap is None:
            return
        turns = session.model_turns() + sum(1 for branch in session.branches if branch.busy) + (0 if holding else 1)
        if turns > cap:
            self.metrics.chat_refused.labels("turn_limit").inc()
            raise TurnLimitReached(
                f"session {session.session_id!r} has run its {cap} model turns (max_turns): the rollout ends here",
                setting="max_turns",
                limit=cap,
                session_id=session.session_id,
            )

    def default_max_tokens(self, prompt_tokens: int) -> int:
        left = None if self.context_tokens is None else self.context_tokens - prompt_tokens
        configured = self.settings.default_max_tokens
        if configured is None:
            return left if left is not None else FALLBACK_MAX_TOKENS
        return configured if left is None else min(configured, left)

    def _check_context(
        self,
        prompt_tokens: int,
        max_tokens: int | None,
        *,
        limit: int | None,
        at_least: bool = False,
    ) -> None:
        """Refuse what does not fit ``limit`` tokens (the model's context, or a session's budget; None: no limit).
        ``at_least``: ``prompt_tokens`` is a lower bound (the text not encoded yet)."""
        if limit is None:
            return
        if prompt_tokens >= limit:
            raise ContextLengthExceeded(
                f"prompt is too long: {prompt_tokens} tokens > {limit - 1} maximum",
                context_tokens=limit,
                prompt_tokens=prompt_tokens,
                max_tokens=None,
                at_least=at_least,
            )
        if max_tokens is not None and prompt_tokens + max_tokens > limit:
            raise ContextLengthExceeded(
                f"input length and `max_tokens` exceed context limit: {prompt_tokens} + {max_tokens} > {limit}, "
                "decrease input length or `max_tokens` and try again",
                context_tokens=limit,
                prompt_tokens=prompt_tokens,
                max_tokens=max_tokens,
            )

    def _begin(self, trajectory: Trajectory, plan: ChatPlan) -> Callable[[], None]:
        if plan.cause is not None:
            self.metrics.chat_drift.labels(plan.cause).inc()
            parent = plan.parent
            log.info(
                "session %s: %s (first differing message %s): branch %d, %s",
                trajectory.session_id,
                plan.cause,
                plan.first_difference,
                trajectory.index,
                "a new root"
                if parent is None
                else f"from token {plan.fork_at} of branch {trajectory.session.index(parent)}",
            )
        undo = apply_plan(self.store, trajectory, plan)
        try:
            self.store.check_growth(trajectory)  # room for the answer: the limits, with the new tokens counted
        except BaseException:
            undo()
            raise
        return undo

    def _finish(self, trajectory: Trajectory, request: ChatRequest, plan: ChatPlan, folded: FoldedTurn) -> ChatResult:
        """Parse the reply and record it; cannot fail on the answer's content (malformed calls stay content)."""
        parsed, reasoning = self.parse(request, plan, folded.plan.turn.text)
        reply = self.reply(folded, parsed, reasoning)
        stored = folded.summary["rid"] if request.api == "responses" and request.store else None
        record_reply(trajectory, request, plan, reply.message, stored, unparsed=parsed.failed)
        if trajectory.branch.model is None:
            trajectory.branch.model = request.model
        mode = "stream" if request.stream else "unary"
        self.metrics.chat_turns.labels(request.api, mode, reply.finish).inc()
        return ChatResult(trajectory.session_id, trajectory.index, reply, folded, plan.delta.render_s, request)

    # ---- parts ------------------------------------------------------------------------------------------------
    def starts_inside_reasoning(self, plan: ChatPlan) -> bool:
        return self.reasoning is not None and self.reasoning.starts_inside(plan.delta.text[-256:])

    def parse(self, request: ChatRequest, plan: ChatPlan, text: str) -> tuple[ParsedCompletion, str | None]:
        """The completion as content, tool calls and reasoning."""
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(text, inside=self.starts_inside_reasoning(plan))
        if not request.parse_tool_calls:
            return ParsedCompletion(text, ()), reasoning
        parsed = self.tool_format.parse(text, request.tools)
        if parsed.failed:
            self.metrics.chat_tool_parse_failures.labels(self.tool_format.name).inc()
        return parsed, reasoning

    def splitter(self, request: ChatRequest, plan: ChatPlan) -> ReplySplitter:
        reasoning = None
        if self.reasoning is not None:
            reasoning = self.reasoning.stream(inside=self.starts_inside_reasoning(plan))
        tools = self.tool_format.splitter() if request.parse_tool_calls else None
        return ReplySplitter(reasoning, tools)

    @staticmethod
    def reply(folded: FoldedTurn, parsed: ParsedCompletion, reasoning: str | None) -> AssistantReply:
        turn, summary = folded.plan.turn, folded.summary
        finish = FINISH.get(turn.finish_type or "", "stop")
        if finish == "stop" and parsed.tool_calls:
            finish = "tool_calls"
        return AssistantReply(
            message=ChatMessage("assistant", parsed.content, parsed.tool_calls, reasoning=reasoning),
            finish=finish,  # type: ignore[arg-type]
            completion_tokens=turn.num_tokens,
            prompt_tokens=int(summary["prompt_length"]),
            # a resumed turn's counters sum its requests' (gateway.resume): the client's usage is of its prompt
            cached_tokens=min(turn.cached_tokens, int(summary["prompt_length"])),
            rid=str(summary["rid"]),
        )


# What a chat turn asks SGLang for when the parsers' markers are special tokens of the served tokenizer: SGLang
# leaves special tokens out of the text by default, and a parser cannot read markers that are not there.
KEEP_SPECIAL_TOKENS = {"skip_special_tokens": False, "spaces_between_special_tokens": False}


def text_of_special_markers(
    template: ChatTemplate, tools: ToolCallFormat, reasoning: ReasoningFormat | None
) -> dict[str, Any]:
    """The sampling parameters every chat turn adds (a request's own win): ``KEEP_SPECIAL_TOKENS`` when a marker
    the parsers read is a special token of the tokenizer (gpt-oss's harmony, Kimi-K2's tool tokens), else none."""
    markers = {tools.start, *tools.markers, *(reasoning.markers if reasoning is not None else ())}
    return dict(KEEP_SPECIAL_TOKENS) if markers & template.special_texts else {}


def merge_late_system_messages(messages: tuple[ChatMessage, ...]) -> tuple[ChatMessage, ...]:
    """For a template that cannot render a system message after the first: each such message is merged into the
    user message before it (appended), else the next one (prepended), so that the model still reads it once."""
    out: list[ChatMessage] = []
    pending: list[str] = []
    for i, message in enumerate(messages):
        if message.role == "system" and i > 0:
            if out and out[-1].role == "user":
                out[-1] = msgspec.structs.replace(out[-1], content=f"{out[-1].content}\n\n{message.content}")
            else:
                pending.append(message.content)
            continue
        if pending and message.role == "user":
            message = msgspec.structs.replace(message, content="\n\n".join([*pending, message.content]))
            pending = []
        out.append(message)
    if pending:
        raise ChatRequestError(
            "a system message after the first has no user message to join, and this model's chat template renders "
            "system messages only at the start",
            param="messages",
        )
    return tuple(out)


def _turn_request(request: ChatRequest) -> TurnCreate:
    """The chat turn as a token-level turn; resumed when the engine aborts it (a harness cannot resume it itself)."""
    params = {**request.sampling_params, "max_new_tokens": request.max_tokens}
    return TurnCreate.model_validate({"sampling_params": params, "stream": request.stream, "resume": True})


class ReplySplitter:
    """A streamed completion split as it arrives into reasoning and content, the content holding back what may be
    tool calls; ``finish`` gives what remains of each so that the streamed text equals the unary answer's."""

    def __init__(self, reasoning: ReasoningSplitter | None, tools: ToolCallStreamSplitter | None) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._content_sent = 0

    def feed(self, piece: str) -> tuple[str, str]:
        """``(reasoning, content)`` safe to send now."""
        if self._reasoning is None:
            return "", self._content(piece)
        reasoning: list[str] = []
        content: list[str] = []
        for channel, text in self._reasoning.feed(piece):
            if channel == "reasoning":
                reasoning.append(text)
            else:
                content.append(self._content(text))
        return "".join(reasoning), "".join(content)

    def _content(self, piece: str) -> str:
        out = piece if self._tools is None else self._tools.feed(piece)
        self._content_sent += len(out)
        return out

    def finish(self, message: ChatMessage) -> tuple[str, str]:
        """What remains to send of the reasoning and the content, once the completion is whole and parsed into
        ``message``."""
        reasoning = self._reasoning.finish(message.reasoning) if self._reasoning is not None else ""
        content = message.content[self._content_sent :] if len(message.content) > self._content_sent else ""
        return reasoning, content


@dataclass
class StreamEvent:
    """What the API adapters turn into their own events: reasoning and content text, then one end."""

    text: str = ""
    reasoning: str = ""
    end: bool = False
    reply: AssistantReply | None = None  # the end of a turn that was folded (whole, or partial)
    error: dict[str, Any] | None = None  # the end of a failed turn: the gateway's error body
    result: ChatResult | None = None
    error_status: int = 500  # the error's HTTP status, for the APIs whose error types follow it


@dataclass
class ChatStream:
    service: ChatService
    trajectory: Trajectory
    request: ChatRequest
    plan: ChatPlan
    undo: Callable[[], None]
    turn: StreamTurn | None = None
    result: ChatResult | None = None
    _splitter: ReplySplitter | None = field(default=None, init=False)

    def ended(self, folded: FoldedTurn | None) -> None:
        """``StreamTurn``'s end hook, with the session still held: record the reply, or undo the new tokens."""
        if folded is None:
            self.undo()
            return
        self.result = self.service._finish(self.trajectory, self.request, self.plan, folded)

    async def events(self) -> AsyncIterator[StreamEvent]:
        assert self.turn is not None
        self._splitter = self.service.splitter(self.request, self.plan)
        error: dict[str, Any] | None = None
        kept = True  # an error event without a ``turn``: nothing of the turn was kept (its store write failed too)
        async with aclosing(self.turn.event_batches()) as batches:
            async for batch, ended in batches:
                reasoning, text = self._pieces(batch)
                for event in batch:
                    if event["type"] == "error":
                        error, kept = event["error"], event.get("turn") is not None
                if text or reasoning:
                    yield StreamEvent(text=text, reasoning=reasoning)
                if ended:
                    yield self._end(error, kept)

    def _pieces(self, batch: list[dict[str, Any]]) -> tuple[str, str]:
        assert self._splitter is not None
        reasoning: list[str] = []
        content: list[str] = []
        for event in batch:
            if event["type"] == "delta" and event["text"]:
                r, c = self._splitter.feed(event["text"])
                reasoning.append(r)
                content.append(c)
        return "".join(reasoning), "".join(content)

    def _end(self, error: dict[str, Any] | None, kept: bool) -> StreamEvent:
        """The stream's last event. The reply (its stop, its tool calls) goes only with a turn the session kept: the
        turn's task sends its last event once the store has written it, and a failed write ends it as an error."""
        result = self.result if kept else None
        if result is None:  # nothing folded, or not kept: the session is as before the request
            fallback = GatewayError("the turn ended without an answer").to_body()["error"]
            return StreamEvent(end=True, error=error or fallback)
        ended = result.folded.error
        if ended is not None:  # kept in the session, but not the model's answer: an error, never a finish
            return StreamEvent(end=True, error=ended.to_body()["error"], result=result, error_status=ended.status_code)
        assert self._splitter is not None
        reasoning, rest = self._splitter.finish(result.reply.message)
        return StreamEvent(
            text=rest,
            reasoning=reasoning,
            end=True,
            reply=result.reply,
            error=error,
            result=result,
        )
