"""A chat session's tree of branches, each with its record of messages, and how a new request maps onto them.

Each request carries the whole history (the chat APIs are stateless). Each branch of the session keeps the messages
it has seen and, for each message the model wrote, where in the branch's tokens it ends. A request is matched against
every branch's record (message by message, ``ChatMessage.same_message``):

- it **continues** the branch whose record it extends (the longest such record): only its new messages are rendered,
  after that branch's tokens;
- else it **forks** (drift policy ``fork``, the default) a new branch from the branch with which it shares the longest
  prefix ending at a message the model wrote: that prefix's tokens (unchanged) are the new branch's prompt, so each
  generated token is trained once, in the branch that generated it;
- else it starts a **new root** branch (a side conversation: another system prompt, a subagent).

With drift policy ``reject`` a request that extends no branch is a 409 ``history_mismatch``. A template that renders
the earlier messages differently once new ones follow (``rewrote``) is handled by the rewrite policy: ``append`` (the
new messages as the template renders them after the history, on the same branch) or ``fork`` (the conversation
re-rendered as the template renders it now, on a new branch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from gateway.chat.messages import ChatMessage, ChatRequest, Tool, ToolCall, tools_key
from gateway.chat.template import ChatTemplate, Rendered
from gateway.errors import HistoryMismatch, InvalidRequest
from gateway.sample import SessionSample
from gateway.store import Branch, Session, SessionStore, Trajectory

DriftPolicy = Literal["fork", "reject"]
RewritePolicy = Literal["append", "fork"]


@dataclass(frozen=True, slots=True)
class ChatRecord:
    messages: tuple[ChatMessage, ...]
    # Per message: the branch's token count right after it when the model wrote it (where a branch can continue);
    # None for messages that were rendered.
    ends: tuple[int | None, ...]
    tools: tuple[Tool, ...]
    # Per message: the id of the answer that carried it when the model wrote it and the client may continue from it
    # (the Responses API's previous_response_id), else None.
    responses: tuple[str | None, ...] = ()
    # The messages the model wrote whose tool-call markup the parser could not read (kept as their text): slime's
    # ``ill_formed``. Indices into ``messages``, usually none.
    unparsed: tuple[int, ...] = ()
    tools_key: bytes = field(init=False, repr=False)  # compared with every request's: made once

    def __post_init__(self) -> None:
        object.__setattr__(self, "tools_key", tools_key(self.tools))

    def find_response(self, response_id: str) -> int | None:
        """How many leading messages make up the conversation as of the answer ``response_id`` (None: no such
        answer in this record)."""
        for i, known in enumerate(self.responses):
            if known == response_id:
                return i + 1
        return None

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
            "unparsed": list(self.unparsed),
        }

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> ChatRecord:
        return cls(
            messages=tuple(_message_from_json(m) for m in value["messages"]),
            ends=tuple(value["ends"]),
            tools=tuple(Tool(**tool) for tool in value["tools"]),
            responses=tuple(value.get("responses") or ()),
            unparsed=tuple(value.get("unparsed") or ()),
        )

    def model_messages(self) -> list[ChatMessage]:
        """The messages the model wrote (the parent's part of a forked branch's conversation included)."""
        return [message for message, end in zip(self.messages, self.ends, strict=True) if end is not None]

    def slime_flags(self) -> dict[str, bool]:
        """slime's per-sample flags over the whole conversation (``TrajectoryManager._chain_to_samples``):
        ``use_tool``, a message the model wrote calls a tool; ``ill_formed``, one had tool calls that could not be
        read."""
        return {
            "use_tool": any(message.tool_calls for message in self.model_messages()),
            "ill_formed": bool(self.unparsed),
        }

    def branch_point(self, common: int) -> int:
        """The longest prefix of ``common`` messages that ends with a message the model wrote (0: none)."""
        for count in range(common, 0, -1):
            if self.ends[count - 1] is not None:
                return count
        return 0


DriftCause = Literal["edited_history", "new_root", "rewrite"]


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """What a chat request does to its session before the model turn, decided before anything changes: the branch it
    continues, or the new branch it starts (from ``parent``'s first ``fork_at`` tokens, or from nothing)."""

    branch: Branch | None  # the branch the request continues; None: it starts a new one
    parent: Branch | None  # a new branch's parent (None: a new root)
    history: int  # leading messages of the request that are already in the branch (or the new branch's parent)
    fork_at: int  # a new branch: how many of the parent's tokens it starts from; a continued one: its token count
    delta: Rendered  # the tokens the request adds before the model answers
    as_prompt: bool  # the delta is (more) prompt rather than tokens after the model's last reply
    first_difference: int | None = None  # a new branch: the first message that differs from the parent's record
    cause: DriftCause | None = None  # why the request did not simply extend a branch (a metric's label)
    record: ChatRecord | None = None  # the continued branch's record as planned against (re-checked when held)

    def tokens_after(self) -> int:
        return self.fork_at + len(self.delta.ids)

    def new_branch(self, session: Session, model: str | None) -> Branch:
        """The branch this plan starts (its prompt so far: the parent's first ``fork_at`` tokens)."""
        assert self.branch is None
        source = self.parent.sample if self.parent is not None else session.sample  # a root: its replay settings
        return Branch(
            source.branch(self.fork_at),  # fork_at is 0 for a new root
            parent=self.parent,
            fork_token=self.fork_at,
            first_difference=self.first_difference,
            cause=self.cause,
            model=model,
        )


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


@dataclass(frozen=True, slots=True)
class Match:
    """Where a request stands against the session's tree, before any rendering: it renders the whole conversation
    (``history`` 0: the session's first, or a new root), or continues after its first ``history`` messages, which
    are ``source``'s record's (the branch itself when ``fork`` is False)."""

    source: Branch | None  # the branch whose record the request shares ``history`` messages with
    history: int
    fork: bool  # a new branch: from ``source`` (when ``history``), else a new root
    first_difference: int | None = None

    @property
    def renders_all(self) -> bool:
        return self.history == 0

    @property
    def tokens_before(self) -> int:
        """The tokens the rendered text will follow."""
        if self.renders_all or self.source is None:
            return 0
        end = self.source.record.ends[self.history - 1]
        return end if end is not None else 0


def match_request(session: Session, request: ChatRequest, policy: DriftPolicy) -> Match:
    """Match the request against every branch's record (message by message: O(its messages), no rendering)."""
    root = session.branches[0]
    chats = [branch for branch in session.branches if branch.record is not None]
    if not chats:
        if len(root.sample.tokens):
            raise InvalidRequest(
                f"session {session.session_id!r} was created with prompt_ids: chat requests need a session created "
                "without them (its first chat request renders the prompt)"
            )
        if not root.busy:  # the session's first conversation: the root branch
            return Match(root, 0, fork=False)
        return Match(None, 0, fork=True, first_difference=0)
    common = {branch: branch.record.common_prefix(request) for branch in chats}
    extended = [b for b in chats if common[b] == len(b.record.messages)]  # a record's last message is the model's
    if extended:
        branch = max(extended, key=lambda b: (len(b.record.messages), b.updated_at))
        return Match(branch, len(branch.record.messages), fork=False)
    if policy == "reject":
        closest = max(chats, key=lambda b: common[b])
        raise HistoryMismatch(
            f"message {common[closest]} of the request differs from every branch's record (drift policy: reject)",
            session_id=session.session_id,
            first_difference=common[closest],
            recorded_messages=len(closest.record.messages),
            branch=session.index(closest),
        )
    points = {branch: branch.record.branch_point(common[branch]) for branch in chats}
    parent = max(chats, key=lambda b: (points[b], b.updated_at))
    if not points[parent]:
        return Match(None, 0, fork=True, first_difference=max(common.values()))
    return Match(parent, points[parent], fork=True, first_difference=common[parent])


def plan_match(template: ChatTemplate, match: Match, request: ChatRequest, rewrite: RewritePolicy) -> ChatPlan:
    """Render what the request adds where ``match`` put it."""
    if match.renders_all:
        prompt = template.prompt(request.messages, request.tools)
        if not match.fork:
            return ChatPlan(match.source, None, 0, 0, prompt, as_prompt=True)
        return ChatPlan(None, None, 0, 0, prompt, True, first_difference=match.first_difference, cause="new_root")
    parent = match.source
    assert parent is not None
    plan = _continue(template, parent, request, match.history, rewrite)
    if not match.fork:
        return plan
    if plan.branch is None:  # re-rendered: a new branch already
        return replace(plan, first_difference=match.first_difference)
    return replace(
        plan,
        branch=None,
        parent=parent,
        fork_at=parent.record.ends[match.history - 1],
        first_difference=match.first_difference,
        cause=plan.cause or "edited_history",
        record=None,
    )


def render_size(template: ChatTemplate, match: Match, request: ChatRequest, rewrite: RewritePolicy) -> int:
    """Characters the template will render for this request (what decides whether it is done off the event loop):
    only the new messages when the history's local context is enough."""
    messages = request.messages[match.history :] if match.history and _local(template, rewrite) else request.messages
    size = sum(m.text_size for m in messages)
    return size + len(request.tools_key) if match.renders_all else size  # the tools are in a whole prompt


def _local(template: ChatTemplate, rewrite: RewritePolicy) -> bool:
    """Whether a continued conversation renders only its history's local context (O(new messages) per turn): under
    ``append``, with a template that passes ``renders_locally``; ``fork`` must see a rewrite anywhere in the history,
    so it renders all of it."""
    return rewrite == "append" and template.renders_locally


def _continue(
    template: ChatTemplate, branch: Branch, request: ChatRequest, history: int, rewrite: RewritePolicy
) -> ChatPlan:
    """The request's messages after its first ``history`` ones, which end with a message the model wrote: on
    ``branch`` when those are its whole record, else at the end of that message (a fork)."""
    record: ChatRecord = branch.record
    tokens = branch.sample.tokens.view()
    end = record.ends[history - 1]
    assert end is not None
    # The recorded messages, not the request's: the same messages (``same_message``), but as the model wrote them
    # (a client may have dropped their reasoning).
    done, new = record.messages[:history], request.messages[history:]
    local = _local(template, rewrite)
    continuation = template.continuation(done, new, request.tools, last_token=int(tokens[end - 1]), local=local)
    if continuation.rendered is None or (continuation.rewrote and rewrite == "fork"):
        return _rerendered(template, branch, tokens, replace(request, messages=(*done, *new)))
    cause: DriftCause | None = "rewrite" if continuation.rewrote else None
    return ChatPlan(
        branch, None, history, len(tokens), continuation.rendered, as_prompt=False, cause=cause, record=record
    )


def _rerendered(template: ChatTemplate, parent: Branch, tokens: np.ndarray, request: ChatRequest) -> ChatPlan:
    """The whole conversation rendered as the template renders it now, as the prompt of a new branch that shares
    the leading tokens the two have in common (the ``fork`` rewrite policy: what the deployed model would see)."""
    prompt = template.prompt(request.messages, request.tools)
    shared = common_token_prefix(tokens, prompt.ids[:-1])  # at least one new token: the branch's own prompt
    rest = Rendered(prompt.ids[shared:], prompt.text, prompt.render_s)
    return ChatPlan(None, parent, 0, shared, rest, as_prompt=True, cause="rewrite")


def common_token_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def apply_plan(store: SessionStore, trajectory: Trajectory, plan: ChatPlan) -> Callable[[], None]:
    """Add the plan's tokens to the branch the turn holds; returns the undo, for when the model turn fails (a new
    branch is dropped whole)."""
    sample: SessionSample = trajectory.sample
    mark = sample.mark()
    if plan.as_prompt:
        sample.append_prompt_tokens(plan.delta.ids)
    else:
        sample.append_tool_tokens(plan.delta.ids, plan.delta.text)
    store.recount(trajectory.session)

    def undo() -> None:
        if plan.branch is None:
            store.drop_branch(trajectory)
            return
        sample.rollback(mark)
        store.recount(trajectory.session)

    return undo


def record_reply(
    trajectory: Trajectory,
    request: ChatRequest,
    plan: ChatPlan,
    reply: ChatMessage,
    response_id: str | None,
    *,
    unparsed: bool = False,
) -> None:
    """The request's messages and the model's reply become the branch's record (``response_id``: the answer's id,
    when a later request may continue from it; ``unparsed``: the reply had tool-call markup that could not be
    read)."""
    source = plan.branch if plan.branch is not None else plan.parent
    record: ChatRecord | None = None if source is None else source.record
    kept = record.ends[: plan.history] if record is not None and plan.history else ()
    known = record.responses[: plan.history] if record is not None and plan.history else ()
    recorded = record.messages[: plan.history] if record is not None else ()  # as the model wrote them
    new = len(request.messages) - plan.history
    earlier = tuple(i for i in record.unparsed if i < plan.history) if record is not None else ()
    messages = (*recorded, *request.messages[plan.history :], reply)
    trajectory.branch.record = ChatRecord(
        messages=messages,
        ends=(*kept, *([None] * new), len(trajectory.sample.tokens)),
        tools=request.tools,
        responses=(*known, *([None] * (plan.history - len(known))), *([None] * new), response_id),
        unparsed=(*earlier, len(messages) - 1) if unparsed else earlier,
    )


def find_response(session: Session, response_id: str) -> tuple[ChatMessage, ...] | None:
    """The conversation as of a stored answer, from whichever branch holds it (None: no branch does)."""
    for branch in session.branches:
        count = None if branch.record is None else branch.record.find_response(response_id)
        if count is not None:
            return branch.record.messages[:count]
    return None
