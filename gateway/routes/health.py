from __future__ import annotations

import time

from fastapi import APIRouter, Response

from gateway import __version__
from gateway import openapi as doc
from gateway.responses import json_response
from gateway.state import StateDep

router = APIRouter(tags=["health"])


@router.get(
    "/health",
    responses={
        **doc.answers(200, "the gateway is up", (doc.JSON, doc.ref(doc.Health))),
        **doc.answers(
            503, "draining (SIGTERM, GATEWAY_DRAIN_S): take it out of rotation", (doc.JSON, doc.ref(doc.Health))
        ),
        **doc.errors(),
    },
)
async def health(state: StateDep) -> Response:
    """200 while the gateway serves; 503 ``draining`` once a SIGTERM started its drain (it still serves every
    request it gets: only a load balancer's health checks are told to move on)."""
    return json_response(
        {
            "status": "draining" if state.drain.draining else "ok",
            "version": __version__,
            "instance_id": state.instance_id,
            "upstream_url": state.settings.upstream_base,
            "sessions": state.store.count,
            "uptime_s": round(time.time() - state.started_at, 3),
            "fleet_channel": state.store.listening,  # hears the other replicas' gateway-wide actions (None: alone)
        },
        status_code=503 if state.drain.draining else 200,
    )
