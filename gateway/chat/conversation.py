"""A chat session's record of messages, and how a new request's history maps onto the session's tokens.

Each request carries the whole history (the chat APIs are stateless). The session keeps the messages it has seen
and, for each message the model wrote, where in the tokens it ends. A request whose history starts with the record
(message by message, ``ChatMessage.same_message``) extends it: only its new messages are rendered, after the
session's tokens. One that disagrees (the client edited, dropped or reordered earlier messages: drift) is handled
by the drift policy:

- ``fork`` (default): the session's trajectory so far becomes a finished branch, and a new branch continues from
  the longest common prefix that ends with a message the model wrote (its tokens unchanged), or from nothing. Each
  branch is its own training sample, so each generated response is trained once.
- ``reject``: 409 ``history_mismatch``, the session unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from gateway.chat.messages import ChatMessage, ChatRequest, Tool, ToolCall, tools_key
from gateway.chat.template import ChatTemplate, Rendered
from gateway.errors import HistoryMismatch, InvalidRequest
from gateway.store import Session, SessionStore

DriftPolicy = Literal["fork", "reject"]
RewritePolicy = Literal["append", "fork"]


@dataclass(frozen=True, slots=True)
class ChatRecord:
    messages: tuple[ChatMessage, ...]
    # Per message: the session's token count right after it when the model wrote it (where a branch can continue);
    # None for messages that were rendered.
    ends: tuple[int | None, ...]
    tools: tuple[Tool, ...]
    # Per message: the id of the answer that carried it when the model wrote it and the client may continue from it
    # (the Responses API's previous_response_id), else None.
    responses: tuple[str | None, ...] = ()

    def find_response(self, response_id: str) -> int | None:
        """How many leading messages make up the conversation as of the answer ``response_id`` (None: no such
        answer in this record)."""
        for i, known in enumerate(self.responses):
            if known == response_id:
                return i + 1
        return None

    @property
    def tools_key(self) -> bytes:
        return tools_key(self.tools)

    def common_prefix(self, request: ChatRequest) -> int:
        """How many leading messages of ``request`` are the record's (none when the tools differ: they are part of
        the rendered prompt)."""
        if request.tools_key != self.tools_key:
            return 0
        count = 0
        for mine, theirs in zip(self.messages, request.messages, strict=False):
            if not mine.same_message(theirs):
                break
            count += 1
        return count

    def to_json(self) -> dict[str, Any]:
        """For a persistent store (``gateway.redis_store``); ``from_json`` reads it back."""
        return {
            "messages": [_message_json(m) for m in self.messages],
            "ends": list(self.ends),
            "tools": [{"name": t.name, "description": t.description, "parameters": t.parameters} for t in self.tools],
            "responses": list(self.responses),
        }

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> ChatRecord:
        return cls(
            messages=tuple(_message_from_json(m) for m in value["messages"]),
            ends=tuple(value["ends"]),
            tools=tuple(Tool(**tool) for tool in value["tools"]),
            responses=tuple(value.get("responses") or ()),
        )

    def branch_point(self, common: int) -> int:
        """The longest prefix of ``common`` messages that ends with a message the model wrote (0: none)."""
        for count in range(common, 0, -1):
            if self.ends[count - 1] is not None:
                return count
        return 0


DriftCause = Literal["edited_history", "new_root", "rewrite"]


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """What a chat request does to its session before the model turn, decided before anything changes."""

    history: int  # leading messages of the request that are already in the session (or its new branch)
    fork_at: int | None  # None: the session goes on; else a new branch continues from this many tokens
    delta: Rendered  # the tokens the request adds before the model answers
    as_prompt: bool  # the delta is the prompt (a new conversation) rather than tokens after the model's last reply
    first_difference: int | None = None  # drift: the first message that differs from the record
    cause: DriftCause | None = None  # why the request did not simply extend the record (a metric's label)

    def tokens_after(self, session: Session) -> int:
        base = len(session.sample.tokens) if self.fork_at is None else self.fork_at
        return base + len(self.delta.ids)


def _message_json(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {
        "role": message.role,
        "content": message.content,
        "tool_calls": [[c.id, c.name, c.arguments] for c in message.tool_calls],
        "tool_call_id": message.tool_call_id,
        "name": message.name,
    }
    if message.reasoning is not None:
        out["reasoning"] = message.reasoning
    if message.is_error:
        out["is_error"] = True
    return out


def _message_from_json(value: dict[str, Any]) -> ChatMessage:
    calls = tuple(ToolCall(*call) for call in value["tool_calls"])
    return ChatMessage(
        value["role"],
        value["content"],
        calls,
        value["tool_call_id"],
        value["name"],
        reasoning=value.get("reasoning"),
        is_error=bool(value.get("is_error")),
    )


def plan_chat(
    template: ChatTemplate, session: Session, request: ChatRequest, policy: DriftPolicy, rewrite: RewritePolicy
) -> ChatPlan:
    record: ChatRecord | None = session.chat
    tokens = session.sample.tokens.view()
    if record is None:
        if len(tokens):
            raise InvalidRequest(
                f"session {session.session_id!r} was created with prompt_ids: chat requests need a session created "
                "without them (its first chat request renders the prompt)"
            )
        return ChatPlan(0, None, template.prompt(request.messages, request.tools), as_prompt=True)
    common = record.common_prefix(request)
    if common == len(record.messages):  # the request extends the record (its last message is never the model's)
        return _continue(template, tokens, request, common, None, rewrite)
    if policy == "reject":
        raise HistoryMismatch(
            f"message {common} of the request differs from the session's record (drift policy: reject)",
            session_id=session.session_id,
            first_difference=common,
            recorded_messages=len(record.messages),
        )
    point = record.branch_point(common)
    if not point:
        prompt = template.prompt(request.messages, request.tools)
        return ChatPlan(0, 0, prompt, True, first_difference=common, cause="new_root")
    plan = _continue(template, tokens, request, point, record.ends[point - 1], rewrite)
    return replace(plan, first_difference=common, cause=plan.cause or "edited_history")


def _continue(
    template: ChatTemplate,
    tokens: np.ndarray,
    request: ChatRequest,
    history: int,
    fork_at: int | None,
    rewrite: RewritePolicy,
) -> ChatPlan:
    """The request's messages after its first ``history`` ones, which end with a message the model wrote at token
    ``fork_at`` (None: at the end of the session's tokens)."""
    end = len(tokens) if fork_at is None else fork_at
    done, new = request.messages[:history], request.messages[history:]
    continuation = template.continuation(done, new, request.tools, last_token=int(tokens[end - 1]))
    if continuation.rendered is None or (continuation.rewrote and rewrite == "fork"):
        return _rerendered(template, tokens, request)
    cause: DriftCause | None = "rewrite" if continuation.rewrote else None
    return ChatPlan(history, fork_at, continuation.rendered, as_prompt=False, cause=cause)


def _rerendered(template: ChatTemplate, tokens: np.ndarray, request: ChatRequest) -> ChatPlan:
    """The whole conversation rendered as the template renders it now, as the prompt of a new branch that shares
    the leading tokens the two have in common (the ``fork`` rewrite policy: what the deployed model would see)."""
    prompt = template.prompt(request.messages, request.tools)
    shared = common_token_prefix(tokens, prompt.ids[:-1])  # at least one new token: the branch's own prompt
    rest = Rendered(prompt.ids[shared:], "", prompt.render_s)
    return ChatPlan(0, shared, rest, as_prompt=True, first_difference=None, cause="rewrite")


def common_token_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def apply_plan(store: SessionStore, session: Session, plan: ChatPlan) -> Callable[[], None]:
    """Add the plan's tokens (on a new branch when it forks); returns the undo, for when the model turn fails."""
    old_sample, old_branches = session.sample, len(session.branches)
    if plan.fork_at is not None:
        session.branches.append(old_sample)
        session.sample = old_sample.branch(plan.fork_at)
    mark = session.sample.mark()
    if plan.as_prompt:
        session.sample.append_prompt_tokens(plan.delta.ids)
    else:
        session.sample.append_tool_tokens(plan.delta.ids, plan.delta.text)
    store.recount(session)

    def undo() -> None:
        if plan.fork_at is None:
            session.sample.rollback(mark)
        else:
            session.sample = old_sample
            del session.branches[old_branches:]
        store.recount(session)

    return undo


def record_reply(
    session: Session, request: ChatRequest, plan: ChatPlan, reply: ChatMessage, response_id: str | None
) -> None:
    """The request's messages and the model's reply become the session's record (``response_id``: the answer's id,
    when a later request may continue from it)."""
    record: ChatRecord | None = session.chat
    kept = record.ends[: plan.history] if record is not None and plan.history else ()
    known = record.responses[: plan.history] if record is not None and plan.history else ()
    new = len(request.messages) - plan.history
    session.chat = ChatRecord(
        messages=(*request.messages, reply),
        ends=(*kept, *([None] * new), len(session.sample.tokens)),
        tools=request.tools,
        responses=(*known, *([None] * (plan.history - len(known))), *([None] * new), response_id),
    )
