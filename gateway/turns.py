"""One model turn of a session: build the SGLang request, call upstream, decode off-loop, fold."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any

import orjson

from gateway.codec import DecodedTurn, decode_generate_response
from gateway.errors import InvalidRequest
from gateway.schemas import TurnCreate
from gateway.state import GatewayState
from gateway.store import Session

log = logging.getLogger("gateway.turns")

TOP_P_FLAG = "return_top_p_token_ids"


@dataclass(frozen=True, slots=True)
class TurnPlan:
    """What this turn asks of SGLang, decided from the request and the session before anything is sent."""

    rid: str
    want_routing: bool
    want_top_p: bool
    routing_start_len: int
    sampling_params: dict[str, Any]


def plan_turn(session: Session, request: TurnCreate) -> TurnPlan:
    sample = session.sample
    want_routing = sample.moe is not None if request.return_routed_experts is None else request.return_routed_experts
    if want_routing and sample.moe is None:
        raise InvalidRequest(
            "return_routed_experts needs the session's MoE shape: create it with num_layers and moe_router_topk"
        )
    sampling_params = session.sampling_defaults | request.sampling_params
    custom = dict(sampling_params.get("custom_params") or {})
    # Once a session keeps top-p spans, every model turn must bring them (slime's fold requires it).
    want_top_p = bool(custom.get(TOP_P_FLAG)) or sample.top_p_active
    if want_top_p:
        sample.check_can_request_top_p()
        custom[TOP_P_FLAG] = True
        sampling_params = sampling_params | {"custom_params": custom}
    return TurnPlan(
        rid=f"{session.session_id}-{len(sample.turns)}-{uuid.uuid4().hex[:8]}",
        want_routing=want_routing,
        want_top_p=want_top_p,
        routing_start_len=sample.routing_rows if want_routing else 0,
        sampling_params=sampling_params,
    )


def upstream_payload(session: Session, plan: TurnPlan, *, stream: bool = False) -> bytes:
    payload: dict[str, Any] = {
        "input_ids": session.sample.tokens.view(),
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


async def run_turn(state: GatewayState, session: Session, request: TurnCreate) -> dict[str, Any]:
    """Runs with the session held exclusively (see ``SessionStore.exclusive``)."""
    plan = plan_turn(session, request)
    prompt_length = len(session.sample.tokens)
    answer = await state.upstream.post_generate(upstream_payload(session, plan), routing_key=session.session_id)
    decode = partial(decode_generate_response, answer, want_routing=plan.want_routing, want_top_p=plan.want_top_p)
    turn = await state.run_cpu(len(answer), decode)
    record = session.sample.fold_model_turn(turn, routing_start_len=plan.routing_start_len)
    log.debug(
        "session %s turn %d: +%d tokens (%s)",
        session.session_id,
        len(session.sample.turns) - 1,
        turn.num_tokens,
        turn.finish_type,
    )
    return turn_summary(session, plan, turn, prompt_length, record.routing_rows)


def turn_summary(
    session: Session, plan: TurnPlan, turn: DecodedTurn, prompt_length: int, routing_rows: int | None
) -> dict[str, Any]:
    sample = session.sample
    return {
        "session_id": session.session_id,
        "turn": len(sample.turns) - 1,
        "rid": turn.rid or plan.rid,
        "new_token_ids": turn.token_ids.tolist(),
        "text": turn.text,
        "finish_reason": turn.finish_reason,
        "status": sample.status.value,
        "prompt_length": prompt_length,
        "completion_tokens": turn.num_tokens,
        "response_length": sample.response_length,
        "total_tokens": len(sample.tokens),
        "cached_tokens": turn.cached_tokens,
        "prompt_tokens": turn.prompt_tokens,
        "weight_version": turn.weight_version,
        "routed_experts_start_len": plan.routing_start_len if plan.want_routing else None,
        "routed_experts_rows_received": routing_rows,
        "routed_experts_rows": sample.routing_rows,
        "top_p_replay": plan.want_top_p,
    }
