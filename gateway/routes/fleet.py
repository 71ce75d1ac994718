"""Gateway-wide actions (``gateway.fleet``): they reach every replica that shares the session store."""

from __future__ import annotations

from fastapi import APIRouter, Response

from gateway import openapi as doc
from gateway.fleet import abort_everywhere
from gateway.responses import json_response
from gateway.schemas import AbortAll, AbortAllBody
from gateway.state import StateDep

router = APIRouter(prefix="/v1", tags=["fleet"])


@router.post(
    "/abort_all",
    operation_id="abort_all",
    openapi_extra=doc.json_request(AbortAll, required=False),
    responses={
        **doc.answers(200, "the abort, here and sent to the other replicas", (doc.JSON, doc.ref(doc.AbortAllAnswer))),
        **doc.errors(*doc.BODY_ERRORS),
    },
)
async def abort_all(body: AbortAllBody, state: StateDep) -> Response:
    """Abort every running turn on every gateway replica (slime's end of a rollout): each ends aborted-but-coherent,
    its tokens so far folded in. Answers once this replica's turns ended; the others' end as the message reaches
    them (Redis pub/sub)."""
    return json_response((await abort_everywhere(state.runner, state.instance_id, body.reason)).to_json())
