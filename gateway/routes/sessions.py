"""The v1 session API: create, generate (a model turn), append (tool tokens), view, sample, delete."""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Response
from fastapi.responses import StreamingResponse

from gateway.responses import json_response, safetensors_response
from gateway.sample import MoEShape, SessionSample
from gateway.schemas import SampleBatchBody, SessionCreateBody, ToolAppendBody, TurnCreate, TurnCreateBody
from gateway.state import StateDep
from gateway.turns import ABORT_GRACE_S, open_stream_turn, run_turn
from gateway.views import full_view, group_payload, sample_payload, session_summary, session_view

router = APIRouter(prefix="/v1", tags=["sessions"])
ABORT_WAIT_S = ABORT_GRACE_S + 2.0


@router.post("/sessions", status_code=201)
async def create_session(body: SessionCreateBody, state: StateDep) -> Response:
    moe = None if body.num_layers is None else MoEShape(body.num_layers, body.moe_router_topk)  # type: ignore[arg-type]
    session = state.store.create(
        SessionSample.from_prompt(body.prompt_ids, moe),
        session_id=body.session_id,
        metadata=body.metadata,
        sampling_defaults=body.sampling_defaults,
    )
    return json_response(session_summary(session), status_code=201)


@router.get("/sessions")
async def list_sessions(state: StateDep) -> Response:
    sessions = [session_summary(s) for s in state.store]
    return json_response({"count": len(sessions), "sessions": sessions})


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, state: StateDep, full: bool = False) -> Response:
    session = state.store.get(session_id)
    if not full:
        return json_response(session_view(session))
    view = full_view(session)
    return Response(await state.run_cpu(view.nbytes, view.encode), media_type="application/json")


@router.delete("/sessions/{session_id}", status_code=204)
async def delete_session(session_id: str, state: StateDep) -> Response:
    state.store.delete(session_id)
    return Response(status_code=204)


@router.post("/sessions/{session_id}/generate")
async def generate(session_id: str, body: TurnCreateBody, state: StateDep) -> Response:
    if body.stream:
        return await _stream_turn(session_id, body, state)
    async with state.store.exclusive(session_id) as session:
        state.store.check_growth(session)  # the answer itself is checked again before it is folded
        return json_response(await run_turn(state, session, body))


async def _stream_turn(session_id: str, body: TurnCreate, state: StateDep) -> Response:
    session = state.store.acquire(session_id)
    try:
        state.store.check_growth(session)
        turn = await open_stream_turn(state, session, body)
    except BaseException:
        state.store.release(session)  # nothing was sent to the caller yet: a plain HTTP error
        raise
    # From here the turn's own task owns the session and releases it, whatever the caller does.
    return StreamingResponse(
        turn.client_events(), media_type="text/event-stream", headers={"cache-control": "no-cache"}
    )


@router.post("/sessions/{session_id}/abort")
async def abort(session_id: str, state: StateDep) -> Response:
    """Abort the running turn; answers once it has ended (tokens so far folded in, status aborted)."""
    session = state.store.get(session_id)
    running = session.running
    if running is None:
        return json_response(session_summary(session) | {"aborted": False, "detail": "no turn running"})
    running.abort("abort requested by the caller")
    finished = await running.wait(ABORT_WAIT_S)
    return json_response(session_summary(session) | {"aborted": True, "rid": running.rid, "finished": finished})


@router.post("/sessions/{session_id}/append")
async def append(session_id: str, body: ToolAppendBody, state: StateDep) -> Response:
    async with state.store.exclusive(session_id) as session:
        state.store.check_growth(session, len(body.token_ids))
        with state.store.growing(session, len(body.token_ids)):
            session.sample.append_tool_tokens(np.asarray(body.token_ids, dtype=np.int32), body.text)
        state.metrics.turns.labels("tool", "appended").inc()
        state.metrics.folded_tokens.labels("false").inc(len(body.token_ids))
        return json_response(session_summary(session))


@router.get("/sessions/{session_id}/sample")
async def get_sample(session_id: str, state: StateDep) -> Response:
    payload = sample_payload(state.store.get(session_id))
    return safetensors_response(await state.run_cpu(payload.nbytes, payload.encode))


@router.post("/samples")
async def get_samples(body: SampleBatchBody, state: StateDep) -> Response:
    payload = group_payload([state.store.get(sid) for sid in body.session_ids])
    return safetensors_response(await state.run_cpu(payload.nbytes, payload.encode))
