"""What callers see of a session: the curl view (JSON) and the compact sample (safetensors)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from gateway.codec import narrowest_unsigned, safetensors_stream
from gateway.errors import BranchNotFound
from gateway.sample import SessionSample
from gateway.store import Branch, Session, last_error

if TYPE_CHECKING:
    from gateway.chat.conversation import ChatRecord
    from gateway.chat.messages import ChatMessage
    from gateway.turns import FoldedTurn

LAST_TOKENS_SHOWN = 16
# A branch's place in the tree, in the view's branches[i] and in its sample's metadata (Session.branch_meta).
BRANCH_KEYS = ("parent", *Branch.TREE_FIELDS)


def session_summary(session: Session) -> dict[str, Any]:
    return session.summary()


def session_view(session: Session, branch: int | None = None) -> dict[str, Any]:
    """The curl view of one branch (the root by default): the session's summary, that branch's sample and chat
    record, and the whole tree in ``branches``."""
    chosen = _branch_of(session, branch)
    sample = chosen.sample
    arrays = sample.arrays()
    view = (
        session_summary(session)
        | _sample_summary(sample)
        | {
            "branch": session.index(chosen),
            "metadata": session.metadata,
            "closed": session.closed,  # POST /close: no more turns (its samples are being taken)
            "limits": session.limits.to_json(),  # a trainer's caps (max_context_tokens, max_turns)
            "moe": None if sample.moe is None else {"num_layers": sample.moe.num_layers, "topk": sample.moe.topk},
            "replay": {
                "routed_experts": "rollout_routed_experts" in arrays,
                "routed_experts_rows": sample.routing_rows,
                "top_p": sample.top_p_active,
            },
            "arrays": {name: {"shape": list(a.shape), "dtype": str(a.dtype)} for name, a in arrays.items()},
            "weight_versions": sample.weight_versions,
            # what rollout_weight_version_ids index (the turn log has each model turn's spans)
            "weight_version_table": sample.weight_version_table,
            "trained_versions": sample.trained_versions(),  # the versions its trained tokens span: staleness
            "cached_tokens": sample.cached_tokens,
            "prompt_tokens": sample.prompt_tokens,
            "spec_counters": sample.spec_counters,
            "stored_bytes": sample.stored_bytes,
            "response": sample.response,
            "last_tokens": arrays["tokens"][-LAST_TOKENS_SHOWN:].tolist(),
            "turn_log": [t.to_json() for t in sample.turns],
            "inspector": f"/ui/sessions/{session.session_id}",  # the session page of the gateway's inspector (/ui/)
            "branches": [_branch_summary(session, known) for known in session.branches],
        }
    )
    if chosen.record is not None:
        view["chat"] = _chat_view(chosen.record)
    return view


def _sample_summary(sample: SessionSample) -> dict[str, Any]:
    return {
        "status": sample.status.value,
        "prompt_length": sample.prompt_length,
        "response_length": sample.response_length,
        "total_tokens": len(sample.tokens),
        "turns": len(sample.turns),
    }


def _branch_summary(session: Session, branch: Branch) -> dict[str, Any]:
    """A branch as the view's ``branches[i]`` shows it: where it stands in the tree, its sample's lengths."""
    meta = session.branch_meta(branch)
    extra = {
        "busy": branch.busy,
        "chat": branch.record is not None,
        "last_error": last_error(branch.sample),
        "trained_versions": branch.sample.trained_versions(),
    }
    return meta | _sample_summary(branch.sample) | extra


CHAT_CONTENT_SHOWN = 200


def _chat_view(record: ChatRecord) -> dict[str, Any]:
    """The chat record as the curl view shows it: each message, its content cut short, where the model's end."""
    return {
        "tools": [tool.name for tool in record.tools],
        "messages": [_message_view(message, end) for message, end in zip(record.messages, record.ends, strict=True)],
    }


def _message_view(message: ChatMessage, end: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.content[:CHAT_CONTENT_SHOWN]}
    if message.tool_calls:
        out["tool_calls"] = [{"name": c.name, "arguments": c.arguments} for c in message.tool_calls]
    out["generated_until_token"] = end  # the model wrote it: the session's token count right after it
    return out


# Elements per orjson call when a full view is encoded: ~0.5 ms each, so the thread doing it hands the GIL (and the
# event loop) back every few ms instead of holding it for the ~100 ms of a 10k-token MoE session's arrays.
FULL_VIEW_SLICE_ELEMENTS = 1 << 16


@dataclass(frozen=True, slots=True)
class FullView:
    """``GET /v1/sessions/{id}?full=true``: the view plus every array as JSON lists. Taken on the event loop (the
    arrays are views, safe to read from another thread: see ``SamplePayload``), encoded by ``encode`` off it."""

    view: dict[str, Any]
    arrays: dict[str, np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def encode(self) -> bytes:
        full = b",".join(b'"%s":%s' % (name.encode(), _json_array(a)) for name, a in self.arrays.items())
        return orjson.dumps(self.view)[:-1] + b',"full":{' + full + b"}}"


def full_view(session: Session, branch: int | None = None) -> FullView:
    chosen = _branch_of(session, branch)
    view = session_view(session, branch)
    if chosen.record is not None:  # the record whole: every message's text, the tools with their schemas
        view["chat"]["record"] = chosen.record.to_json()
    return FullView(view, chosen.sample.arrays())


def _branch_of(session: Session, branch: int | None) -> Branch:
    """The session's branch number ``branch`` (None: the root, 0)."""
    if branch is None:
        return session.branches[0]
    if not 0 <= branch < len(session.branches):
        raise BranchNotFound(
            f"session {session.session_id!r} has branches 0..{len(session.branches) - 1}, not {branch}",
            branches=len(session.branches),
        )
    return session.branches[branch]


def _json_array(values: np.ndarray) -> bytes:
    """``values`` as nested JSON lists, encoded a slice of rows at a time."""
    if not len(values):
        return b"[]"
    rows = max(1, FULL_VIEW_SLICE_ELEMENTS // max(1, values[0].size))
    pieces = [
        orjson.dumps(values[start : start + rows], option=orjson.OPT_SERIALIZE_NUMPY)[1:-1]
        for start in range(0, len(values), rows)
    ]
    return b"[" + b",".join(pieces) + b"]"


def sample_metadata(session: Session, branch: Branch | None = None) -> dict[str, str]:
    """safetensors metadata is str -> str: scalars as text (an empty string for none), structures as JSON.
    ``branch``: one of the session's (default: the root), whose place in the tree the metadata carries."""
    branch = session.branches[0] if branch is None else branch
    sample = branch.sample
    tree = session.branch_meta(branch)
    meta = {
        "session_id": session.session_id,
        "branch": str(tree["branch"]),
        "branches": str(len(session.branches)),
        **{key: "" if tree[key] is None else str(tree[key]) for key in BRANCH_KEYS},
        "status": sample.status.value,
        "response": sample.response,
        "response_length": str(sample.response_length),
        "prompt_length": str(sample.prompt_length),
        "weight_versions": orjson.dumps(sample.weight_versions).decode(),
        "weight_version_table": orjson.dumps(sample.weight_version_table).decode(),
        "trained_versions": orjson.dumps(sample.trained_versions()).decode(),
        "cached_tokens": str(sample.cached_tokens),
        "prompt_tokens": str(sample.prompt_tokens),
        "spec_counters": orjson.dumps(sample.spec_counters).decode(),
        "turns": str(len(sample.turns)),
        "metadata": orjson.dumps(session.metadata).decode(),
    }
    if branch.record is not None:  # a chat branch: slime's flags over its whole conversation
        meta["chat"] = orjson.dumps(branch.record.slime_flags()).decode()
    if sample.moe is not None:
        meta["num_layers"] = str(sample.moe.num_layers)
        meta["moe_router_topk"] = str(sample.moe.topk)
    return meta


@dataclass(frozen=True, slots=True)
class SamplePayload:
    """A snapshot of one or more samples, taken on the event loop and safe to encode in another thread:
    the arrays are views, and session buffers only ever grow past them (see ``GrowableArray.replace_tail``)."""

    arrays: dict[str, np.ndarray]
    metadata: dict[str, str]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def encode(self) -> bytes:
        # The gateway's own safetensors writer, not the package's: the package keeps the metadata in a Rust HashMap
        # and writes it in a new order each call, so an unchanged session gave different bytes on every fetch.
        return b"".join(safetensors_stream(self.arrays, self.metadata).chunks())


def sample_payload(session: Session, branch: int | None = None) -> SamplePayload:
    chosen = _branch_of(session, branch)
    return SamplePayload(chosen.sample.arrays(), sample_metadata(session, chosen))


def turn_payload(folded: FoldedTurn) -> SamplePayload:
    """One model turn's own tensors, in the sample's layout, so a caller never re-fetches the history: the new
    tokens (all trainable), their log-probs, top-p spans (offsets from 0) and the routing rows it brought, which
    replace the caller's rows from ``routed_experts_first_row`` on (slime's fold with ``routed_experts_start_len``).
    The summary (as JSON, without the token ids the tensors carry) is in the metadata under ``turn``, the session's
    weight version table (which this turn's ``rollout_weight_version_ids`` index) under ``weight_version_table``."""
    plan, turn = folded.plan, folded.plan.turn
    arrays = {
        "tokens": turn.token_ids,
        "loss_mask": np.ones(turn.num_tokens, np.uint8),
        "rollout_log_probs": turn.log_probs,
    }
    if turn.top_p_ids is not None and turn.top_p_offsets is not None and turn.num_tokens:
        arrays["rollout_top_p_token_ids"] = turn.top_p_ids
        arrays["rollout_top_p_token_offsets"] = turn.top_p_offsets
    arrays["rollout_weight_version_ids"] = plan.versions.ids  # indexes into the table in the metadata
    summary = {key: value for key, value in folded.summary.items() if key != "new_token_ids"}
    metadata = {
        "kind": "turn",
        "turn": orjson.dumps(summary).decode(),
        "weight_version_table": orjson.dumps(folded.version_table).decode(),
    }
    if plan.routing is not None:
        arrays["rollout_routed_experts"] = plan.routing.rows.astype(narrowest_unsigned(plan.routing.max_id), copy=False)
        metadata["routed_experts_first_row"] = str(plan.routing.keep_rows)
    return SamplePayload(arrays, metadata)


def group_payload(sessions: list[Session]) -> SamplePayload:
    """A whole group in one safetensors file: tensors named ``{i}/{field}``, metadata under ``samples``. Each
    branch of a session is its own sample (a chat session's tree has several, in the order they were started), so
    each generated response is trained once."""
    arrays: dict[str, np.ndarray] = {}
    samples: list[dict[str, str]] = []
    for session in sessions:
        for branch in session.branches:
            arrays.update({f"{len(samples)}/{name}": a for name, a in branch.sample.arrays().items()})
            samples.append(sample_metadata(session, branch))
    metadata = {"samples": orjson.dumps(samples).decode(), "count": str(len(samples))}
    return SamplePayload(arrays, metadata)
