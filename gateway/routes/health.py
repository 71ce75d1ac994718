from __future__ import annotations

import time

from fastapi import APIRouter, Response

from gateway import __version__
from gateway import openapi as doc
from gateway.responses import json_response
from gateway.state import StateDep

router = APIRouter(tags=["health"])


@router.get(
    "/health", responses={**doc.answers(200, "the gateway is up", (doc.JSON, doc.ref(doc.Health))), **doc.errors()}
)
async def health(state: StateDep) -> Response:
    return json_response(
        {
            "status": "ok",
            "version": __version__,
            "instance_id": state.instance_id,
            "upstream_url": state.settings.upstream_base,
            "sessions": state.store.count,
            "uptime_s": round(time.time() - state.started_at, 3),
        }
    )
