"""The v1 session API: create, generate (a model turn), append (tool tokens), view, sample, delete."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse

from gateway import openapi as doc
from gateway.closing import close_session
from gateway.codec import safetensors_stream
from gateway.errors import GatewayError
from gateway.responses import SAFETENSORS_MEDIA_TYPE, SafetensorsResponse, json_response, safetensors_response
from gateway.sample import MoEShape, SessionSample, Status
from gateway.schemas import (
    SampleBatchBody,
    SampleBatchRequest,
    SessionClose,
    SessionCloseBody,
    SessionCreate,
    SessionCreateBody,
    ToolAppend,
    ToolAppendBody,
    TurnCreate,
    TurnCreateBody,
)
from gateway.state import GatewayState, StateDep
from gateway.store import SessionLimits
from gateway.turns import FoldedTurn, abort_turns
from gateway.views import full_view, group_payload, sample_payload, session_summary, session_view, turn_payload

router = APIRouter(prefix="/v1", tags=["sessions"])
FINISHED = frozenset({Status.COMPLETED, Status.TRUNCATED})  # slime never generates for these samples again


@router.post(
    "/sessions",
    status_code=201,
    operation_id="create_session",
    openapi_extra=doc.json_request(SessionCreate, required=False),
    responses={
        **doc.answers(
            201,
            "the session's summary; with `generate`, the first turn's summary, or with `Accept: "
            "application/vnd.safetensors` its tensors",
            (doc.JSON, {"anyOf": [doc.ref(doc.SessionSummary), doc.ref(doc.TurnSummary)]}),
            (doc.SAFETENSORS, doc.BINARY),
            links=doc.session_links(),
        ),
        **doc.errors(*doc.BODY_ERRORS, *doc.UPSTREAM_ERRORS, 409, 429, 507),
    },
)
async def create_session(body: SessionCreateBody, state: StateDep, request: Request) -> Response:
    moe = None if body.num_layers is None else MoEShape(body.num_layers, body.moe_router_topk)  # type: ignore[arg-type]
    session = await state.store.create(
        SessionSample.from_prompt(np.empty(0, np.int32) if body.prompt_ids is None else body.prompt_ids, moe),
        session_id=body.session_id,
        metadata=body.metadata,
        sampling_defaults=body.sampling_defaults,
        limits=SessionLimits(max_context_tokens=body.max_context_tokens, max_turns=body.max_turns),
        resume=body.resume,
    )
    if body.generate is None:
        return json_response(session_summary(session), status_code=201)
    # The session and its first turn in one round trip, all or nothing: a failed turn leaves no session behind, so
    # the call can be sent again as it is.
    try:
        folded = await _unary_turn(state, session.session_id, body.generate)
    except BaseException:
        with contextlib.suppress(GatewayError):
            await state.store.delete(session.session_id)
        raise
    return await _turn_response(state, folded, request, status_code=201)


@router.get(
    "/sessions",
    operation_id="list_sessions",
    responses={**doc.answers(200, "the sessions", (doc.JSON, doc.ref(doc.SessionList))), **doc.errors()},
)
async def list_sessions(state: StateDep) -> Response:
    sessions = await state.store.list_sessions()
    return json_response({"count": len(sessions), "sessions": sessions})


@router.get(
    "/sessions/{session_id}",
    operation_id="get_session",
    responses={**doc.answers(200, "the session's view", (doc.JSON, doc.ref(doc.SessionView))), **doc.errors(404, 422)},
)
async def get_session(
    session_id: str,
    state: StateDep,
    full: bool = False,
    branch: Annotated[int | None, Query(ge=0)] = None,
) -> Response:
    """The curl view of the root branch, or ``?branch=N`` another of a chat session's; ``?full=true`` adds every array
    (and the chat record whole)."""
    session = await state.store.get(session_id)
    if not full:
        return json_response(session_view(session, branch))
    view = full_view(session, branch)
    return Response(await state.run_cpu(view.nbytes, view.encode), media_type="application/json")


@router.delete(
    "/sessions/{session_id}",
    operation_id="delete_session",
    status_code=204,
    response_class=Response,
    responses={204: {"description": "deleted"}, **doc.errors(404, 409)},
)
async def delete_session(session_id: str, state: StateDep) -> Response:
    await state.store.delete(session_id)
    return Response(status_code=204)


@router.post(
    "/sessions/{session_id}/generate",
    operation_id="generate",
    openapi_extra=doc.json_request(TurnCreate, required=False),
    responses={
        **doc.answers(
            200,
            "the turn's summary; with `stream`, its events (token deltas, then the summary as a `turn` event, or an "
            "`error` event); with `Accept: application/vnd.safetensors`, the turn's own tensors",
            (doc.JSON, doc.ref(doc.TurnSummary)),
            (doc.SSE, doc.SSE_EVENT),
            (doc.SAFETENSORS, doc.BINARY),
        ),
        **doc.errors(*doc.BODY_ERRORS, *doc.UPSTREAM_ERRORS, 404, 409, 507),
    },
)
async def generate(session_id: str, body: TurnCreateBody, state: StateDep, request: Request) -> Response:
    if body.stream:
        return await _stream_turn(session_id, body, state)
    return await _turn_response(state, await _unary_turn(state, session_id, body), request)


async def _unary_turn(state: GatewayState, session_id: str, body: TurnCreate) -> FoldedTurn:
    async with state.store.exclusive(session_id) as trajectory:
        state.store.check_growth(trajectory)  # the answer itself is checked again before it is folded
        folded = await state.runner.run(trajectory, body)
    status = folded.plan.status_after
    if body.delete_after_turn == "always" or (body.delete_after_turn == "if_finished" and status in FINISHED):
        await state.store.delete(session_id)
    return folded


async def _turn_response(
    state: GatewayState, folded: FoldedTurn, request: Request, *, status_code: int = 200
) -> Response:
    """The summary as JSON, or with ``Accept: application/vnd.safetensors`` the turn's own tensors
    (``gateway.views.turn_payload``): what a trainer needs without fetching the session's history."""
    if SAFETENSORS_MEDIA_TYPE not in request.headers.get("accept", ""):
        return json_response(folded.summary, status_code=status_code)
    payload = turn_payload(folded)
    return safetensors_response(await state.run_cpu(payload.nbytes, payload.encode), status_code=status_code)


async def _stream_turn(session_id: str, body: TurnCreate, state: StateDep) -> Response:
    trajectory = await state.store.acquire(session_id)
    try:
        state.store.check_growth(trajectory)
        turn = await state.runner.open_stream(trajectory, body)
    except BaseException:
        await state.store.release(trajectory)  # nothing was sent to the caller yet: a plain HTTP error
        raise
    # From here the turn's own task owns the session and releases it, whatever the caller does.
    return StreamingResponse(
        turn.client_events(), media_type="text/event-stream", headers={"cache-control": "no-cache"}
    )


@router.post(
    "/sessions/{session_id}/abort",
    operation_id="abort",
    responses={
        **doc.answers(200, "whether a turn was aborted", (doc.JSON, doc.ref(doc.AbortAnswer))),
        **doc.errors(404),
    },
)
async def abort(session_id: str, state: StateDep) -> Response:
    """Abort the running turns (a chat session's branches may each run one); answers once they have ended (tokens so
    far folded in, status aborted)."""
    session = await state.store.get(session_id)
    turns = session.running_turns()
    if not turns:
        elsewhere = await state.store.holder(session_id)
        if elsewhere is not None:  # a replica sharing the Redis store runs it: aborts go to the turn's owner
            detail = f"the turn runs on gateway instance {elsewhere}: send the abort to that replica"
            return json_response(
                session_summary(session) | {"aborted": False, "detail": detail, "instance_id": elsewhere}
            )
        return json_response(session_summary(session) | {"aborted": False, "detail": "no turn running"})
    finished = await abort_turns(turns, "abort requested by the caller")
    rids = [running.rid for running in turns]
    return json_response(
        session_summary(session) | {"aborted": True, "rid": rids[0], "rids": rids, "finished": finished}
    )


@router.post(
    "/sessions/{session_id}/close",
    operation_id="close_session",
    openapi_extra=doc.json_request(SessionClose, required=False),
    responses={
        **doc.answers(
            200, "the session's summary, and how its turns were drained", (doc.JSON, doc.ref(doc.CloseAnswer))
        ),
        **doc.errors(*doc.BODY_ERRORS, 404),
    },
)
async def close(session_id: str, body: SessionCloseBody, state: StateDep) -> Response:
    """Close the session before taking its samples: from now on every turn asked for is refused (409
    ``session_closed``, in each chat API's own shape); running turns get ``wait_timeout_s`` to end, then are aborted.
    Answers once none runs (``drained``), or the wait and the abort are over. Idempotent."""
    session, drain = await close_session(state.store, state.metrics, session_id, float(body.wait_timeout_s))
    return json_response(session_summary(session) | drain.to_json())


@router.post(
    "/sessions/{session_id}/append",
    operation_id="append",
    openapi_extra=doc.json_request(ToolAppend, required=True),
    responses={
        **doc.answers(200, "the session's summary", (doc.JSON, doc.ref(doc.SessionSummary))),
        **doc.errors(*doc.BODY_ERRORS, 404, 409, 507),
    },
)
async def append(session_id: str, body: ToolAppendBody, state: StateDep) -> Response:
    async with state.store.exclusive(session_id) as trajectory:
        trajectory.session.check_open()
        if body.sync is not None:
            trajectory.check_sync(body.sync.total_tokens, body.sync.last_tokens)
        state.store.check_growth(trajectory, len(body.token_ids))
        with state.store.growing(trajectory, len(body.token_ids)):
            trajectory.sample.append_tool_tokens(np.asarray(body.token_ids, dtype=np.int32), body.text)
        trajectory.branch.touch()
        state.metrics.turns.labels("tool", "appended").inc()
        state.metrics.folded_tokens.labels("false").inc(len(body.token_ids))
        return json_response(session_summary(trajectory.session))  # once released: not busy


@router.get(
    "/sessions/{session_id}/sample",
    operation_id="get_sample",
    response_class=SafetensorsResponse,
    responses={**doc.answers(200, "the sample, as safetensors", (doc.SAFETENSORS, doc.BINARY)), **doc.errors(404, 422)},
)
async def get_sample(session_id: str, state: StateDep, branch: Annotated[int | None, Query(ge=0)] = None) -> Response:
    """The root branch's sample, or ``?branch=N`` one of a chat session's (``branches`` in the view)."""
    payload = sample_payload(await state.store.get(session_id), branch)
    return safetensors_response(await state.run_cpu(payload.nbytes, payload.encode))


@router.post(
    "/samples",
    operation_id="get_samples",
    response_class=SafetensorsResponse,
    openapi_extra=doc.json_request(SampleBatchRequest, required=True),
    responses={
        **doc.answers(200, "the samples, as one safetensors file", (doc.SAFETENSORS, doc.BINARY)),
        **doc.errors(*doc.BODY_ERRORS, 404),
    },
)
async def get_samples(body: SampleBatchBody, state: StateDep) -> Response:
    """A whole group, streamed from the sessions' own arrays: a group of 64 big samples is never copied whole."""
    payload = group_payload([await state.store.get(sid) for sid in body.session_ids])
    stream = safetensors_stream(payload.arrays, payload.metadata)

    async def chunks() -> AsyncIterator[bytes | memoryview]:
        for chunk in stream.chunks():
            yield chunk

    headers = {"content-length": str(stream.size)}
    return StreamingResponse(chunks(), media_type=SAFETENSORS_MEDIA_TYPE, headers=headers)
