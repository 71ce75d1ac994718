"""Response helpers shared by the route modules."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import Response

SAFETENSORS_MEDIA_TYPE = "application/vnd.safetensors"


def json_response(content: Any, status_code: int = 200) -> Response:
    # orjson directly: these views can hold long token lists, and FastAPI's default encoder walks them in Python.
    return Response(orjson.dumps(content), status_code=status_code, media_type="application/json")


class SafetensorsResponse(Response):
    media_type = SAFETENSORS_MEDIA_TYPE


def safetensors_response(body: bytes, status_code: int = 200) -> Response:
    return SafetensorsResponse(body, status_code=status_code)
