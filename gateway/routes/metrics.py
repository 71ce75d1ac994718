from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from gateway import openapi as doc
from gateway.state import StateDep


class PrometheusResponse(Response):
    media_type = CONTENT_TYPE_LATEST


router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    response_class=PrometheusResponse,
    responses={**doc.answers(200, "Prometheus metrics", (doc.PROMETHEUS, {"type": "string"})), **doc.errors()},
)
async def metrics(state: StateDep) -> Response:
    return PrometheusResponse(state.metrics.render())
