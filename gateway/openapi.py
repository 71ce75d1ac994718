"""The OpenAPI document (``GET /openapi.json``, ``/docs``): what the gateway takes and answers, for the tools that
generate clients and tests from it.

FastAPI's own document knows little of it: the v1 routes read their bodies through ``gateway.schemas.json_body``
(no request body appears), answer raw ``Response`` objects (every answer appears as JSON, the safetensors and SSE
ones included), every error is ``{"error": ...}`` (FastAPI declares 422 as its ``{"detail": ...}``), and the
passthrough routes are plain Starlette routes (absent). So the routes describe themselves with the helpers here
(``json_request``, ``answers``, ``errors``), and ``install`` builds the document from them:

- request bodies: the pydantic models the routes validate with, their schemas in ``components``;
- every error status a route can answer, each with the one error schema (``ErrorBody``);
- the real media types: safetensors (``application/vnd.safetensors``), server-sent events (``text/event-stream``),
  Prometheus text;
- the SGLang passthrough routes (``passthrough_paths``), their bodies and answers the upstream's;
- the API key scheme when the gateway has keys (``/health``, and ``/metrics`` unless protected, need none).

A route describes itself with them, e.g. (the chat routes' errors, in each API's own shape, also fit ``ErrorBody``:
an ``error`` object with ``type`` and ``message``)::

    @router.post(
        "/chat/completions",
        openapi_extra=doc.json_request(ChatCompletionRequest, required=True),
        responses={
            **doc.answers(200, "the completion, or with stream its chunks", (doc.JSON, doc.ref(ChatCompletion)),
                          (doc.SSE, doc.SSE_EVENT)),
            **doc.errors(*doc.BODY_ERRORS, *doc.UPSTREAM_ERRORS, 404, 409, 501),
        },
    )
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import msgspec
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

from gateway.config import Settings

SAFETENSORS = "application/vnd.safetensors"
SSE = "text/event-stream"
PROMETHEUS = CONTENT_TYPE_LATEST
JSON = "application/json"
# A reference to a schema ``build_document`` puts in ``components`` (``ref``, ``component``): the schema's import path
# (a pydantic model, or a JSON schema as a dict) and its name there. Not a ``$ref`` yet, since pydantic resolves the
# ``$ref``s of the schemas it builds (``WithJsonSchema``) against its own definitions.
COMPONENT_KEY = "x-gateway-component"
_SCHEMAS_PREFIX = "#/components/schemas/"

# Why each status is answered (the error types are gateway.errors').
ERROR_STATUSES: dict[int, str] = {
    400: "upstream_rejected: the SGLang upstream refused the request (its status in upstream_status); chat routes: "
    "chat_template_error, context_length_exceeded",
    401: "unauthorized: no, a malformed or a wrong API key (WWW-Authenticate says which)",
    404: "session_not_found, branch_not_found, previous_response_not_found (the Responses API) (or not_found: no "
    "such route)",
    405: "method_not_allowed (the Allow header lists the methods the path takes)",
    408: "header_timeout / body_timeout: the request head or body did not arrive in time (the connection is closed)",
    409: "session_exists, session_busy (a turn is running), session_mismatch (sync), history_mismatch (chat), "
    "session_closed (a turn on a closed session), session_conflict (a valid body this session cannot take now: no "
    "prompt yet, routing without a MoE shape, top-p replay from the middle of a sample)",
    413: "request_too_large (GATEWAY_MAX_REQUEST_BYTES, GATEWAY_CHAT_MAX_TOOLS_BYTES) or session_too_long "
    "(GATEWAY_MAX_SESSION_TOKENS)",
    422: "invalid_request: the body or a parameter is not what this document says (errors lists each problem)",
    429: "too_many_sessions (GATEWAY_MAX_SESSIONS), turn_limit_reached (the session's max_turns: chat routes)",
    500: "internal_error: a bug (the reference is in the gateway log)",
    501: "chat_not_configured: the gateway was started without a tokenizer",
    502: "upstream_error, upstream_protocol_error, replay_data_dropped, upstream_connection_lost: the upstream's "
    "answer could not be used (nothing was changed)",
    503: "upstream_unavailable, store_unavailable, too_many_connections: safe to retry (nothing was changed); chat "
    "routes: turn_interrupted, turn_aborted (the engine or the trainer ended the turn: the session keeps it)",
    504: "upstream_timeout (GATEWAY_REQUEST_TIMEOUT_S)",
    507: "store_full (GATEWAY_MAX_STORED_BYTES)",
}
# What any route may answer: a key problem, an unknown method, a late request, a bug, the connection cap.
COMMON_ERRORS = (401, 405, 408, 500, 503)
# What a route that reads a body may answer besides.
BODY_ERRORS = (413, 422)
# What a route that calls the upstream may answer besides.
UPSTREAM_ERRORS = (400, 502, 503, 504)


class ErrorDetail(BaseModel):
    """``type`` names the error (gateway.errors); limits add ``setting`` and ``limit``, validation ``errors``."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(description="the error type, e.g. session_not_found, request_too_large, upstream_timeout")
    message: str = Field(description="what went wrong, in words")


class ErrorBody(BaseModel):
    """Every error the gateway answers, whatever its status."""

    error: ErrorDetail


# ---- the answers' schemas (for the document only: the routes answer with orjson) ------------------------------------
Status = Literal["pending", "completed", "truncated", "aborted"]


class SessionSummary(BaseModel):
    """What every session answer starts with (``GET /v1/sessions`` lists these)."""

    model_config = ConfigDict(extra="allow")

    session_id: str
    status: Status
    busy: bool = Field(description="a turn is running on it")
    prompt_length: int
    response_length: int
    total_tokens: int
    turns: int
    branch_count: int = Field(description="the session's branches (1 for a token-level session)")
    created_at: float
    updated_at: float
    last_error: str | None = Field(description="why the last model turn ended early (an abort), or null")


class SessionList(BaseModel):
    model_config = ConfigDict(extra="allow")

    count: int
    sessions: list[SessionSummary]


class TrainedVersions(BaseModel):
    """The weight versions a branch's trained tokens (loss mask 1) come from, in the order the branch met them."""

    first: str | None = Field(description="the oldest (null: no trained token of a known version)")
    last: str | None = Field(description="the newest")
    count: int = Field(description="how many distinct versions")
    tokens: dict[str, int] = Field(description="trained tokens per version")
    unknown_tokens: int = Field(description="trained tokens of no known version (the upstream sent none)")


class BranchSummary(BaseModel):
    """One branch of the session's tree: where it stands, its sample's lengths."""

    model_config = ConfigDict(extra="allow")

    branch: int
    parent: int | None = Field(description="the branch it forked from (null: a root)")
    fork_token: int = Field(description="leading tokens it shares with its parent")
    first_difference: int | None = Field(description="the first message of the forking request unlike the parent's")
    cause: Literal["edited_history", "new_root", "rewrite"] | None
    model: str | None = Field(description="the model name of the request that started it")
    created_at: float
    updated_at: float
    turns: int
    status: Status
    prompt_length: int
    response_length: int
    total_tokens: int
    busy: bool
    last_error: str | None
    trained_versions: TrainedVersions


class SessionView(SessionSummary):
    """The human view of one branch (``?branch=N``, the root by default): the summary, the shapes and dtypes of the
    arrays, replay, weight versions, the turn log, the last tokens, every branch of the tree; with ``full=true``
    every array as JSON lists besides (and a chat branch's record whole)."""

    branch: int = Field(description="the branch shown (0: the root)")
    branches: list[BranchSummary]
    metadata: dict[str, Any] | None
    closed: bool = Field(description="closed (POST /close): every turn asked for is refused")
    limits: dict[str, int | None] = Field(description="a trainer's caps: max_context_tokens, max_turns (null: none)")
    moe: dict[str, int] | None
    replay: dict[str, Any]
    arrays: dict[str, Any]
    weight_versions: list[str | None]
    trained_versions: TrainedVersions
    response: str
    last_tokens: list[int]
    turn_log: list[dict[str, Any]]


class TurnSummary(BaseModel):
    """A model turn's answer (never the big arrays: the sample has them)."""

    model_config = ConfigDict(extra="allow")

    session_id: str
    turn: int
    rid: str
    new_token_ids: list[int]
    text: str
    finish_reason: dict[str, Any] | None
    status: Status
    prompt_length: int
    completion_tokens: int
    response_length: int
    total_tokens: int
    routed_experts_rows: int
    resumed: int = Field(0, description="times the engine aborted it mid-answer and it was resubmitted")
    interrupted: ErrorDetail | None = Field(
        None,
        description="why it ended before the model ended it: turn_aborted (the caller, the trainer), "
        "turn_interrupted (an engine abort not resumed: its reason)",
    )


class AbortAnswer(SessionSummary):
    aborted: bool = Field(description="whether a turn was running here and was aborted")
    detail: str | None = None
    rid: str | None = None
    rids: list[str] | None = Field(None, description="every aborted turn's (one per branch with a turn running)")
    finished: bool | None = Field(None, description="the aborted turns ended within the wait")
    instance_id: str | None = Field(None, description="the replica running the turn, when another one runs it")


class AbortAllAnswer(BaseModel):
    aborted: int = Field(description="turns this replica was running, aborted (ended before the answer)")
    published: bool = Field(description="whether the abort went out to the other replicas over the shared store")
    receivers: int = Field(description="the other replicas' subscriptions Redis delivered it to")


class CloseAnswer(SessionSummary):
    closed: Literal[True]
    drained: bool = Field(description="no turn holds the session any more (false: one still ran after the abort)")
    waited_s: float = Field(description="how long the close took")
    aborted_rids: list[str] = Field(description="the turns that were still running at the end of the wait, aborted")
    instance_id: str | None = Field(None, description="the replica that still runs a turn on it, when another does")


class Health(BaseModel):
    model_config = ConfigDict(extra="allow")

    status: Literal["ok", "draining"]
    version: str
    instance_id: str
    upstream_url: str
    sessions: int
    uptime_s: float
    fleet_channel: bool | None = Field(
        None, description="whether this replica hears the others' gateway-wide actions (None: it has no others)"
    )


# The chat APIs' answers, as each API defines them (the fields clients read; more may come, the gateway's own
# ``gateway`` object among them).
CHAT_COMPLETION = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {
        "object": {"const": "chat.completion"},
        "choices": {"type": "array", "items": {"type": "object", "required": ["index", "message", "finish_reason"]}},
        "usage": {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"]},
    },
}
ANTHROPIC_MESSAGE = {
    "type": "object",
    "required": ["id", "type", "role", "model", "content", "stop_reason", "usage"],
    "properties": {
        "type": {"const": "message"},
        "role": {"const": "assistant"},
        "content": {"type": "array", "items": {"type": "object", "required": ["type"]}},
    },
}
ANTHROPIC_TOKEN_COUNT = {
    "type": "object",
    "required": ["input_tokens"],
    "properties": {"input_tokens": {"type": "integer", "minimum": 0}},
}
RESPONSE = {
    "type": "object",
    "required": ["id", "object", "created_at", "status", "model", "output"],
    "properties": {
        "object": {"const": "response"},
        "status": {"enum": ["completed", "incomplete", "failed", "in_progress"]},
        "output": {"type": "array", "items": {"type": "object", "required": ["type"]}},
    },
}


def json_request(model: type[BaseModel] | type[msgspec.Struct], *, required: bool = True) -> dict[str, Any]:
    """``openapi_extra`` for a route that validates its JSON body with ``model``, a pydantic model or (the chat
    routes) a msgspec struct (read as JSON whatever its Content-Type; an empty body is ``{}`` unless ``required``)."""
    return {"requestBody": {"required": required, "content": {JSON: {"schema": ref(model)}}}}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses`` entries for these error statuses and ``COMMON_ERRORS``, each with ``ErrorBody``."""
    return {status: _error_response(status) for status in sorted({*COMMON_ERRORS, *statuses})}


def answers(
    status: int, description: str, *media: tuple[str, dict[str, Any]], links: dict[str, Any] | None = None
) -> dict[int | str, dict[str, Any]]:
    """A ``responses`` entry for a success answered in several media types: ``(media type, schema)`` pairs; with
    ``links``, the operations its answer leads to (``session_links``)."""
    answer: dict[str, Any] = {
        "description": description,
        "content": {kind: {"schema": schema} for kind, schema in media},
    }
    if links:
        answer["links"] = links
    return {status: answer}


# The operations a new session's id leads to (the v1 routes' operation ids).
SESSION_OPERATIONS = (
    "get_session",
    "session_base",
    "generate",
    "append",
    "abort",
    "get_sample",
    "delete_session",
    "chat_completions",
    "responses",
    "anthropic_messages",
    "anthropic_count_tokens",
)


def session_links() -> dict[str, Any]:
    """OpenAPI links from a created session to the operations on it (its id from the answer's ``session_id``), for
    clients and tools that follow them (a test generator reaches real sessions this way)."""
    session_id = "$response.body#/session_id"
    links: dict[str, Any] = {
        operation: {"operationId": operation, "parameters": {"session_id": session_id}}
        for operation in SESSION_OPERATIONS
    }
    links["get_samples"] = {"operationId": "get_samples", "requestBody": {"session_ids": [session_id]}}
    return links


def ref(model: type[BaseModel] | type[msgspec.Struct]) -> dict[str, Any]:
    """A reference to ``model``'s schema (a pydantic model's, or a msgspec struct's under the name msgspec gives
    it: ``_schemas_of``), which the document's ``components`` will hold."""
    return component(model.__module__ + ":" + model.__qualname__, model.__name__)


def component(target: str, name: str, **keywords: Any) -> dict[str, Any]:
    """A reference to the schema at ``target`` (``module:attribute``: a pydantic model, or a JSON schema dict), which
    the document's ``components`` will hold as ``name``; ``keywords`` beside the reference (a description)."""
    return {COMPONENT_KEY: [target, name], **keywords}


BINARY = {"type": "string", "format": "binary"}
# One server-sent event (tools that read the stream check each against it): a JSON object in ``data``, or the last
# event's ``[DONE]`` (the v1 turns' and OpenAI's streams end with it, Anthropic's do not).
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {
            "anyOf": [
                {"const": "[DONE]"},
                {
                    "type": "string",
                    "contentMediaType": JSON,
                    "contentSchema": {"type": "object"},
                },
            ]
        },
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}


def install(
    app: FastAPI,
    settings: Settings,
    *,
    structs: Sequence[type[msgspec.Struct]] = (),
    paths: dict[str, Any] | None = None,
) -> None:
    """Serve the document described above as ``app``'s (built once, on the first ``GET /openapi.json``).
    ``structs``: the msgspec request models the routes reference (their components are made together, see
    ``_schemas_of``); ``paths``: operations FastAPI does not see (the passthrough's, ``passthrough_paths``)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_document(app, settings, structs=structs, paths=paths or {})
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customize the document


def build_document(
    app: FastAPI,
    settings: Settings,
    *,
    structs: Sequence[type[msgspec.Struct]] = (),
    paths: dict[str, Any] | None = None,
) -> dict[str, Any]:
    document = get_openapi(
        title=app.title,
        version=app.version,
        description=app.description,
        routes=app.routes,
        openapi_version=app.openapi_version,
    )
    document["paths"].update(copy.deepcopy(paths or {}))
    schemas: dict[str, Any] = document.setdefault("components", {}).setdefault("schemas", {})
    for operation in _operations(document):
        _errors_in_our_schema(operation)
    for unused in ("HTTPValidationError", "ValidationError"):  # FastAPI's {"detail": ...}: never answered
        schemas.pop(unused, None)
    pending = _references(document)
    while pending:  # a schema added may reference others
        name, target = pending.popitem()
        for key, schema in _schemas_of(name, _resolve(target), structs).items():
            if key not in schemas:
                schemas[key] = schema
                pending |= _references(schema)
    if settings.api_keys:
        _add_security(document, settings)
    return document


def _operations(document: dict[str, Any]) -> Iterable[dict[str, Any]]:
    for item in document["paths"].values():
        yield from (operation for method, operation in item.items() if method != "parameters")


def _references(node: Any) -> dict[str, str]:
    """``{name: target}`` of the ``component`` references anywhere in ``node``, each made a ``$ref`` in place."""
    found: dict[str, str] = {}
    if isinstance(node, dict):
        if COMPONENT_KEY in node:
            target, name = node.pop(COMPONENT_KEY)
            node["$ref"] = _SCHEMAS_PREFIX + name
            found[name] = target
        for value in node.values():
            found |= _references(value)
    elif isinstance(node, list):
        for value in node:
            found |= _references(value)
    return found


def _resolve(target: str) -> Any:
    module, _, qualname = target.partition(":")
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def _schemas_of(name: str, target: Any, structs: Sequence[type[msgspec.Struct]]) -> dict[str, Any]:
    """The components a reference needs: a JSON schema dict as it is, a pydantic model's schema and those of the
    models it nests (pydantic's ``$defs``), or a msgspec struct's (the chat routes' requests: all of them at once,
    so that their structs of the same name, three APIs' ``MessageIn``, get names of their own)."""
    if isinstance(target, dict):
        return {name: copy.deepcopy(target)}
    if isinstance(target, type) and issubclass(target, msgspec.Struct):
        models = [*structs, *([] if target in structs else [target])]
        _, components = msgspec.json.schema_components(models, ref_template=_SCHEMAS_PREFIX + "{name}")
        return components
    schema = target.model_json_schema(ref_template=_SCHEMAS_PREFIX + "{model}")
    return {**schema.pop("$defs", {}), name: schema}


def _errors_in_our_schema(operation: dict[str, Any]) -> None:
    """FastAPI adds a 422 with its own ``{"detail": ...}`` body to every route with parameters: the gateway's
    422 is ``ErrorBody`` like every error."""
    responses = operation.get("responses", {})
    if "422" in responses:
        responses["422"] = _error_response(422)


# ---- the SGLang passthrough ----------------------------------------------------------------------------------------
def passthrough_paths(post_paths: Sequence[str], get_paths: Sequence[str], session_header: str) -> dict[str, Any]:
    """The SGLang passthrough's operations (``gateway.routes.passthrough``), for ``install``'s ``paths``."""
    routing_key = {
        "name": session_header,
        "in": "header",
        "required": False,
        "description": "forwarded upstream as X-SMG-Routing-Key: a consistent_hashing router keeps a session on "
        "one worker",
        "schema": {"type": "string"},
    }
    # Whatever the upstream answered: its status, body and content type (none, for some of SGLang's answers).
    upstream_answer = {"description": "the upstream's answer, status, body and content type as it sent them"}
    failures = {str(status): _error_response(status) for status in sorted({*COMMON_ERRORS, 413, 502, 503, 504})}
    paths: dict[str, Any] = {}
    for path in post_paths:
        paths[path] = {
            "post": {
                "tags": ["sglang passthrough"],
                "summary": f"SGLang's {path}, forwarded unchanged",
                "operationId": f"passthrough_post_{path.strip('/').replace('/', '_')}",
                "parameters": [routing_key],
                "requestBody": {
                    "required": False,
                    "description": "forwarded to the upstream as it came (never parsed)",
                    "content": {JSON: {"schema": {}}},
                },
                "responses": {"default": upstream_answer, **failures},
            }
        }
    for path in get_paths:
        paths[path] = {
            "get": {
                "tags": ["sglang passthrough"],
                "summary": f"SGLang's {path}, forwarded unchanged",
                "operationId": f"passthrough_get_{path.strip('/').replace('/', '_')}",
                "parameters": [routing_key],
                "responses": {"default": upstream_answer, **failures},
            }
        }
    return paths


def _error_response(status: int) -> dict[str, Any]:
    return {"description": ERROR_STATUSES[status], "content": {JSON: {"schema": ref(ErrorBody)}}}


# ---- authentication --------------------------------------------------------------------------------------------------
def _add_security(document: dict[str, Any], settings: Settings) -> None:
    document["components"]["securitySchemes"] = {
        "bearer": {"type": "http", "scheme": "bearer", "description": "GATEWAY_API_KEY, as Authorization: Bearer"},
        "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key", "description": "the same key"},
    }
    document["security"] = [{"bearer": []}, {"x-api-key": []}]
    open_paths: Sequence[str] = ("/health",) if settings.protect_metrics else ("/health", "/metrics")
    for path in open_paths:
        for operation in document["paths"].get(path, {}).values():
            operation["security"] = []
            operation.get("responses", {}).pop("401", None)
