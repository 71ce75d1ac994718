"""The served model's chat template and tokenizer: messages to token ids, and only the new messages after a prefix.

A Hugging Face tokenizer directory given at start (``--tokenizer`` / ``GATEWAY_TOKENIZER``), read with
``AutoTokenizer.from_pretrained(path, local_files_only=True)``: nothing is ever downloaded. Rendering goes through
transformers' ``apply_chat_template`` (the template's Jinja, as the model was trained with it); encoding through the
Rust tokenizer itself, which is safe to call from several threads (the Python wrapper's encode changes shared
truncation state, the known "Already borrowed" failure).

Token-in-token-out: the session's tokens are the truth. Messages already in a session are never re-rendered into
tokens; new messages are rendered as the template renders them after the recorded ones
(``render(history + new) - render(history)``, as text), so the prefix cache and the training sample agree.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from gateway.chat.messages import ChatMessage, Tool
from gateway.errors import ChatTemplateError

log = logging.getLogger("gateway.chat")


@dataclass(frozen=True, slots=True)
class Rendered:
    ids: np.ndarray  # int32
    text: str
    render_s: float  # time in the template and the tokenizer


@dataclass(frozen=True, slots=True)
class Continuation:
    """New messages rendered after a history (``ChatTemplate.continuation``)."""

    rendered: Rendered | None  # None: the template's rendering cannot be split after the history
    rewrote: bool  # the template renders the history differently once the new messages follow it


class ChatTemplate:
    def __init__(self, tokenizer: Any, name: str) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer at {name} has no chat template")
        self.tokenizer = tokenizer
        self.name = name
        self._backend = tokenizer.backend_tokenizer
        self.vocab_size = len(tokenizer)
        size = self._backend.get_vocab_size(with_added_tokens=True)
        pieces = self._backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
        self.max_token_chars = max(1, *(len(piece) for piece in pieces))
        self.stop_token_ids = frozenset(tokenizer.all_special_ids)
        # The tokens SGLang leaves out of a completion's text unless asked not to (skip_special_tokens).
        self.special_texts = frozenset(
            t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special and t.content
        ) | frozenset(t for t in tokenizer.all_special_tokens if t)
        # Never in a client's text: NULs and a random part, new in each process.
        self._probe = f"\x00slime-gateway-probe-{uuid.uuid4().hex}\x00"
        self.assistant_close = self._assistant_close()
        self.renders_system_anywhere = self._renders_system_anywhere()
        self.renders_locally = self._renders_locally()

    @classmethod
    def load(cls, path: str) -> ChatTemplate:
        started = time.perf_counter()
        from transformers import AutoTokenizer  # slow to import (seconds): only when chat is configured

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(f"the tokenizer at {path} has no fast (Rust) implementation")
        template = cls(tokenizer, path)
        log.info(
            "chat: tokenizer %s (%d tokens) loaded in %.1fs; assistant turns close with %r; system messages after "
            "the first are %s",
            path,
            template.vocab_size,
            time.perf_counter() - started,
            template.assistant_close,
            "rendered where they stand"
            if template.renders_system_anywhere
            else "not rendered by the template: they are merged into a neighbouring user message",
        )
        if not template.renders_locally:
            log.warning(
                "chat: the template of %s renders new messages differently depending on messages further back than "
                "the last user turn and the last two messages: every chat turn renders the whole conversation "
                "(its cost grows with the history)",
                path,
            )
        return template

    # ---- rendering -------------------------------------------------------------------------------------------
    def render_text(self, messages: Sequence[ChatMessage], tools: Sequence[Tool], *, generation_prompt: bool) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                [m.template_dict() for m in messages],
                tools=[t.template_dict() for t in tools] or None,
                add_generation_prompt=generation_prompt,
                tokenize=False,
            )
        except Exception as exc:  # the template's own checks (jinja's raise_exception), or its bugs
            raise ChatTemplateError(f"the chat template cannot render these messages: {exc}") from exc
        if not isinstance(text, str):
            raise ChatTemplateError("the chat template did not render text")
        return text

    def encode(self, text: str) -> np.ndarray:
        # The batch form lets go of the GIL while it runs (a long text takes seconds): the event loop goes on.
        ids = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        return np.asarray(ids, dtype=np.int32)

    def fewest_tokens(self, characters: int) -> int:
        """A lower bound on the tokens of any text of ``characters`` characters (no token is longer than the
        vocabulary's longest): what refuses a text too long for the context before encoding it."""
        return -(-characters // self.max_token_chars)

    def prompt(self, messages: Sequence[ChatMessage], tools: Sequence[Tool]) -> Rendered:
        """A whole conversation, ready for the model's answer (a new session, or a branch from nothing)."""
        started = time.perf_counter()
        text = self.render_text(messages, tools, generation_prompt=True)
        return Rendered(self.encode(text), text, time.perf_counter() - started)

    def continuation(
        self,
        history: Sequence[ChatMessage],
        new: Sequence[ChatMessage],
        tools: Sequence[Tool],
        *,
        last_token: int,
        local: bool = False,
    ) -> Continuation:
        """The tokens that follow a history whose last message the model wrote (ending in ``last_token``): the rest
        of that message's closing the model did not write (the template's text after an assistant message, less the
        stop token the model ended with), then exactly the text ``render(history + new, generation prompt)`` has
        after the history's last message.

        That text is found with a probe appended to the last message's content: what follows the probe when the
        message stands alone (its tool calls and closing) is cut from what follows it when the new messages come
        after. Whether the template rendered the earlier messages differently once new ones follow (a template that
        drops earlier reasoning, Qwen3-style) is reported as ``rewrote``; ``text`` is None when the probe cannot
        split the rendering (the template changed the last message's own closing).

        ``local``: render the history's local context only (``local_context``) rather than all of it, so that a turn
        costs O(its new messages), not O(the conversation); exact for templates that pass ``renders_locally``.
        Rewrites are then seen where they touch the local context (the last message: Qwen3-style templates drop
        its reasoning once a new user turn follows), not beyond."""
        started = time.perf_counter()
        if local:
            history = local_context(history)
        probed = [*history[:-1], msgspec.structs.replace(history[-1], content=history[-1].content + self._probe)]
        alone = self.render_text(probed, tools, generation_prompt=False)
        full = self.render_text([*probed, *new], tools, generation_prompt=True)
        at_alone, at_full = alone.find(self._probe), full.find(self._probe)
        if at_alone < 0 or at_full < 0:
            raise ChatTemplateError("the chat template does not render the content of the model's last message")
        rest = alone[at_alone + len(self._probe) :]
        after = full[at_full + len(self._probe) :]
        rewrote = full[:at_full] != alone[:at_alone]
        found = self._after_message(rest, after, last_token)
        if found is None:
            return Continuation(None, rewrote=True)
        text, reclosed = found
        rendered = Rendered(self.encode(text), text, time.perf_counter() - started)
        return Continuation(rendered, rewrote=rewrote or reclosed)

    def _after_message(self, rest: str, after: str, last_token: int) -> tuple[str, bool] | None:
        """The text that follows the model's last message, from what the template renders after the probe when that
        message stands alone (``rest``: its calls and close) and when the new messages follow it (``after``). The
        model wrote the message up to its stop token: what the template closes the message with after that token
        is still to come (ChatML's newline after ``<|im_end|>``); a stop token that the template renders as the
        next message's opening (GLM's ``<|observation|>``, ``<|user|>``) is that opening; a stop token the template
        replaces by another special token once messages follow (harmony's ``<|return|>``, rendered ``<|end|>`` in
        the history) stands for it, and the message counts as rewritten (True). None: no split fits."""
        written = self._stop_text(last_token)
        if written is None:  # the model did not end on a stop token (cut short): all of the close is to come
            return (self.assistant_close + after[len(rest) :], False) if after.startswith(rest) else None
        cut = rest.rfind(written)
        if cut >= 0 and after.startswith(rest[: cut + len(written)]):
            return after[cut + len(written) :], False
        if after.startswith(rest) and after.startswith(written, len(rest)):
            return after[len(rest) + len(written) :], False
        if cut >= 0 and cut + len(written) == len(rest) and after.startswith(rest[:cut]):
            close = max((t for t in self.special_texts if after.startswith(t, cut)), key=len, default=None)
            if close is not None:
                return after[cut + len(close) :], True
        return None

    def _renders_locally(self) -> bool:
        """Whether a continuation rendered from the history's local context is the one rendered from the whole
        history, on conversations of the shapes agents make (tool loops, parallel calls, several user turns, system
        messages in the middle, reasoning): checked once, at load. A template whose rendering of new messages looks
        further back than ``local_context`` fails it, and every turn renders the whole history (O(the
        conversation) per turn: the log says so)."""
        try:
            for history, new, tools in _LOCALITY_PROBES:
                if history[-1].role != "assistant":
                    continue
                whole = self.continuation(history, new, tools, last_token=-1)
                near = self.continuation(history, new, tools, last_token=-1, local=True)
                texts = (None if c.rendered is None else c.rendered.text for c in (whole, near))
                if next(texts) != next(texts) or whole.rewrote != near.rewrote:
                    return False
        except ChatTemplateError:
            return False
        return True

    def _stop_text(self, last_token: int) -> str | None:
        """The text of the stop token the model ended on; None when its last token is not one."""
        if last_token not in self.stop_token_ids:
            return None
        written = self.tokenizer.convert_ids_to_tokens(last_token)
        return written if isinstance(written, str) and written else None

    def _assistant_close(self) -> str:
        probe = [ChatMessage("user", "hi"), ChatMessage("assistant", self._probe)]
        text = self.render_text(probe, (), generation_prompt=False)
        at = text.rfind(self._probe)
        if at < 0:
            raise ValueError(f"the chat template of {self.name} does not render an assistant message's content")
        return text[at + len(self._probe) :]

    def _renders_system_anywhere(self) -> bool:
        """Whether the template renders a system message that is not the first one where it stands (many do; some
        refuse it, some drop it)."""
        probe = [ChatMessage("user", "hi"), ChatMessage("system", self._probe), ChatMessage("user", "there")]
        try:
            return self._probe in self.render_text(probe, (), generation_prompt=True)
        except ChatTemplateError:
            return False


def local_context(history: Sequence[ChatMessage]) -> list[ChatMessage]:
    """What a template needs of a history to render what follows it: the leading system message, the last user
    message (templates place reasoning and tool turns relative to the last user query) and the last two messages (the
    last one's closing, tool-result grouping), in their order."""
    keep = {len(history) - 2, len(history) - 1}
    if history and history[0].role == "system":
        keep.add(0)
    last_user = next((i for i in range(len(history) - 1, -1, -1) if history[i].role == "user"), None)
    if last_user is not None:
        keep.add(last_user)
    return [history[i] for i in sorted(keep) if i >= 0]


def _probe_conversations() -> tuple[tuple[list[ChatMessage], list[ChatMessage], list[Tool]], ...]:
    """Histories ending with the model's message, and what follows them, in the shapes agents make."""
    from gateway.chat.messages import ToolCall

    tool = Tool("lookup", "Look a thing up", {"type": "object", "properties": {"q": {"type": "string"}}})
    call = ChatMessage("assistant", "", (ToolCall("call_a", "lookup", '{"q": "a"}'),), reasoning="Need a.")
    pair = ChatMessage(
        "assistant",
        "Both.",
        (ToolCall("call_b", "lookup", '{"q": "b"}'), ToolCall("call_c", "lookup", '{"q": "c"}')),
        reasoning="Need b and c.",
    )
    answer = ChatMessage("assistant", "Done.", reasoning="All known.")
    system, user = ChatMessage("system", "Be brief."), ChatMessage("user", "Find a, b and c.")
    result = ChatMessage("tool", "a is 1", tool_call_id="call_a")
    results = [
        ChatMessage("tool", "b is 2", tool_call_id="call_b"),
        ChatMessage("tool", "c is 3", tool_call_id="call_c"),
    ]
    late = ChatMessage("system", "Time is short.")
    loop = [system, user, call, result, pair, *results, answer]
    return (
        ([system, user, call], [result], [tool]),
        (loop[:5], results, [tool]),
        ([*loop[:5], *results, answer], [ChatMessage("user", "And d?")], [tool]),
        ([user, answer, ChatMessage("user", "Again."), answer], [late, ChatMessage("user", "Go on.")], []),
        ([system, user, call, result, answer], [ChatMessage("user", "Next.")], [tool]),
    )


_LOCALITY_PROBES = _probe_conversations()
