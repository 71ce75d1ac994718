"""The session inspector: ``GET /ui/`` (the session list) and ``GET /ui/sessions/{id}`` (one session), served from
the static files in ``gateway/ui/static`` (no build step, nothing fetched from elsewhere), and the routes their
scripts call: the list's page of rows, one trajectory's compact data, the login that sets the cookie.

Every page and file is served with a Content-Security-Policy that allows scripts and styles from this origin only
(no inline script, no ``eval``), and the scripts write model and tool text with ``textContent`` or onto a canvas,
never as HTML. The cookie and what it opens: ``gateway.auth``.
"""

from __future__ import annotations

from functools import partial
from importlib.resources import files
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import RedirectResponse
from starlette.staticfiles import StaticFiles

from gateway.auth import UI_COOKIE, cookie_token, presented_key
from gateway.errors import InvalidRequest
from gateway.responses import json_response, safetensors_response
from gateway.sample import Status
from gateway.state import StateDep
from gateway.store import SessionQuery
from gateway.ui import encode_with_pieces, inspector_payload, listing_rows, page_query_metadata, tokenizer_decoder

router = APIRouter(tags=["ui"], include_in_schema=False)

STATIC_DIR = files("gateway.ui") / "static"
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
}
MAX_PAGE_ROWS = 500


STATIC = StaticFiles(directory=str(STATIC_DIR))  # ETag / If-None-Match / Content-Type, and no path outside the folder


async def _file(name: str, request: Request) -> Response:
    response = await STATIC.get_response(name, request.scope)
    response.headers.update(SECURITY_HEADERS)
    if name.endswith(".html"):
        response.headers["cache-control"] = "no-cache"
    return response


@router.get("/ui")
async def ui_root() -> Response:
    return RedirectResponse("/ui/", status_code=308)


@router.get("/ui/")
async def list_page(request: Request) -> Response:
    return await _file("list.html", request)


@router.get("/ui/sessions/{session_id}")
async def session_page(session_id: str, request: Request) -> Response:
    return await _file("session.html", request)


@router.get("/ui/static/{name}")
async def static_file(name: str, request: Request) -> Response:
    return await _file(name, request)


@router.post("/ui/login")
async def login(request: Request, state: StateDep) -> Response:
    """Reached only with a valid key in the header (``gateway.auth``): answers with the cookie that stands in for it
    in the inspector. A gateway without keys needs no login and sets no cookie."""
    if not state.settings.api_keys:
        return json_response({"authenticated": True, "required": False})
    response = json_response({"authenticated": True, "required": True})
    key = presented_key(request.headers.raw)  # valid: the middleware let the request through
    secure = request.url.scheme == "https"
    response.set_cookie(UI_COOKIE, cookie_token(key), httponly=True, samesite="strict", path="/", secure=secure)
    return response


@router.post("/ui/logout")
async def logout() -> Response:
    response = json_response({"authenticated": False})
    response.delete_cookie(UI_COOKIE, httponly=True, samesite="strict", path="/")
    return response


@router.get("/ui/api/sessions")
async def session_rows(
    state: StateDep,
    status: Status | None = None,
    meta: Annotated[list[str], Query(max_length=16)] = [],  # noqa: B006 (FastAPI copies defaults)
    offset: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE_ROWS)] = 50,
) -> Response:
    """A page of the session list, newest first, with the number of sessions that match."""
    try:
        metadata = page_query_metadata(meta)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    query = SessionQuery(status=None if status is None else status.value, metadata=metadata, offset=offset, limit=limit)
    total, rows = await state.store.list_page(query)
    return json_response({"total": total, "offset": offset, "limit": limit, "sessions": listing_rows(rows)})


@router.get("/ui/api/sessions/{session_id}/data")
async def session_data(session_id: str, state: StateDep, branch: int | None = None) -> Response:
    """One trajectory as safetensors: the sample's arrays, its turn log and token texts in the metadata."""
    payload = inspector_payload(await state.store.get(session_id), branch)
    if state.chat is None:
        return safetensors_response(await state.run_cpu(payload.nbytes, payload.encode))
    decode = tokenizer_decoder(state.chat.template.tokenizer)
    encode = partial(encode_with_pieces, payload, decode)
    return safetensors_response(await state.run_cpu(payload.nbytes, encode))
