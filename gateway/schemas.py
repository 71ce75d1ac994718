"""Request bodies of the v1 API (pydantic, strict where a silent coercion would corrupt a sample)."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal, TypeVar

import orjson
from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    WithJsonSchema,
    model_validator,
)

from gateway.bodies import TokenId, TokenIds, WholeNumber, validate_big_body
from gateway.openapi import component

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_JSON_DEPTH = 32
MAX_METADATA_BYTES = 64 * 1024
MAX_NUM_LAYERS = 1024  # DeepSeek-V3: 61, Qwen3-235B: 94
MAX_MOE_TOPK = 256
MAX_SYNC_TOKENS = 64


def _not_a_dot_segment(session_id: str) -> str:
    # "/v1/sessions/./generate" and "/v1/sessions/../generate" are dot segments: clients and proxies resolve them
    # away (RFC 3986 5.2.4) before the request is sent, so such a session could never be reached.
    if session_id in (".", ".."):
        raise ValueError(f"{session_id!r} is a URL dot segment, not usable as a path segment")
    return session_id


SessionId = Annotated[
    StrictStr,
    Field(
        min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:@-]+$", json_schema_extra={"not": {"enum": [".", ".."]}}
    ),
    AfterValidator(_not_a_dot_segment),
]
# Numbers in free-form JSON (and typed ones) fit in 64 bits, whether spelled as integers or not: what orjson can write
# back (an integer beyond it cannot be serialized at all), and what the OpenAPI document can say (to JSON Schema 1e30
# and 10**30 are the same number).
NUMBER_MIN, NUMBER_END = INT64_MIN, INT64_MAX + 1


def number(*, ge: float | None = None, gt: float | None = None, le: float | None = None) -> Any:
    """A JSON number (integer or not) within 64 bits and these bounds, with its JSON schema (pydantic writes none
    that JSON Schema reads for bounds on a union). Non-finite numbers are refused by the models
    (``allow_inf_nan=False``)."""
    lowest = {"ge": NUMBER_MIN} if ge is None and gt is None else {"ge": ge, "gt": gt}
    highest = {"lt": NUMBER_END} if le is None else {"le": le}
    keywords = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "lt": "exclusiveMaximum"}
    bounds = {name: value for name, value in (lowest | highest).items() if value is not None}
    schema = {"type": "number", **{keywords[name]: value for name, value in bounds.items()}}
    return Annotated[StrictInt | StrictFloat, Field(**bounds), WithJsonSchema(schema)]


Number = number()
# The OpenAPI document's name for a free-form JSON value as the gateway takes it (``check_json_value``); its schema
# is ``JSON_VALUE_SCHEMA`` (gateway.openapi puts it in the document's components).
JSON_VALUE_REF = component("gateway.schemas:JSON_VALUE_SCHEMA", "JsonValue")
JSON_VALUE_SCHEMA: dict[str, Any] = {
    "description": "any JSON value, its numbers within 64 bits, nested at most 32 levels deep",
    "anyOf": [
        {"type": "null"},
        {"type": "boolean"},
        {"type": "string"},
        {"type": "number", "minimum": NUMBER_MIN, "exclusiveMaximum": NUMBER_END},
        {"type": "array", "items": JSON_VALUE_REF},
        {"type": "object", "additionalProperties": JSON_VALUE_REF},
    ],
}
JSON_OBJECT_SCHEMA = {"type": "object", "additionalProperties": JSON_VALUE_REF}


def check_json_value(value: Any, where: str, depth: int = 0) -> None:
    """Free-form JSON from a client is stored and sent back (metadata) or sent upstream (sampling params): refuse
    what could not be sent back as it came, instead of failing later or changing it (NaN becomes null in JSON,
    integers beyond 64 bits and deep nesting cannot be serialized at all)."""
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"{where} is nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            raise ValueError(f"{where} is an integer outside the 64-bit range")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} is not a finite number")
        if not NUMBER_MIN <= value < NUMBER_END:
            raise ValueError(f"{where} is a number outside the 64-bit range")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_json_value(item, f"{where}[{index}]", depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_json_value(item, f"{where}.{key}", depth + 1)
    else:
        raise ValueError(f"{where} is not a JSON value")


def _json_object_within(name: str, max_bytes: int) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def check(value: dict[str, Any]) -> dict[str, Any]:
        check_json_value(value, name)
        size = len(orjson.dumps(value))
        if size > max_bytes:
            raise ValueError(f"is {size} bytes of JSON, over the limit of {max_bytes}")
        return value

    return check


Metadata = Annotated[
    dict[str, Any],
    AfterValidator(_json_object_within("metadata", MAX_METADATA_BYTES)),
    WithJsonSchema({**JSON_OBJECT_SCHEMA, "description": f"stored and sent back; at most {MAX_METADATA_BYTES} bytes"}),
]


class SamplingParams(BaseModel):
    """SGLang's ``sampling_params``: the keys a trainer sends are typed, any other key is forwarded as it came (SGLang
    knows more than listed here) once it is plain, finite, storable JSON."""

    model_config = ConfigDict(
        extra="allow", allow_inf_nan=False, json_schema_extra={"additionalProperties": JSON_VALUE_REF}
    )

    temperature: number(ge=0) | None = None
    top_p: number(gt=0, le=1) | None = None
    top_k: Annotated[int, WholeNumber(ge=-1, le=INT32_MAX)] | None = None  # -1: off
    min_p: number(ge=0, le=1) | None = None
    max_new_tokens: Annotated[int, WholeNumber(ge=0, le=INT32_MAX)] | None = None
    min_new_tokens: Annotated[int, WholeNumber(ge=0, le=INT32_MAX)] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    no_stop_trim: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None
    sampling_seed: Annotated[int, WholeNumber(ge=INT64_MIN, le=INT64_MAX)] | None = None
    frequency_penalty: Number | None = None
    presence_penalty: Number | None = None
    repetition_penalty: Number | None = None
    custom_params: Annotated[dict[str, Any], WithJsonSchema(JSON_OBJECT_SCHEMA)] | None = None

    @model_validator(mode="after")
    def _the_rest_is_plain_json(self) -> SamplingParams:
        check_json_value(self.custom_params, "custom_params")
        for key, value in (self.model_extra or {}).items():
            check_json_value(value, key)
        return self


# The typed keys whose whole numbers may come spelled as floats (2.0): forwarded as integers.
_WHOLE_NUMBER_PARAMS = ("top_k", "max_new_tokens", "min_new_tokens", "sampling_seed", "stop_token_ids")


def _sampling_params(value: dict[str, Any]) -> dict[str, Any]:
    """Checked as ``SamplingParams``, kept as the dict the client sent (forwarded upstream as it came, but for the
    whole numbers spelled as floats, which go as integers)."""
    checked = SamplingParams.model_validate(value)
    return value | {key: getattr(checked, key) for key in _WHOLE_NUMBER_PARAMS if value.get(key) is not None}


SamplingParamsDict = Annotated[
    dict[str, Any],
    AfterValidator(_sampling_params),
    WithJsonSchema(component("gateway.schemas:SamplingParams", "SamplingParams")),
]


class _Body(BaseModel):
    # Unknown fields are errors: a misspelt "return_routed_expert" must not silently train without replay.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class SessionSync(_Body):
    """What the caller believes the session holds. Checked before anything changes (409 ``session_mismatch``
    otherwise): a caller that keeps its own copy of the tokens (the slime drop-in) goes straight to the turn
    instead of asking for the session's state first."""

    total_tokens: Annotated[int, WholeNumber(ge=1)]
    last_tokens: Annotated[list[TokenId], Field(max_length=MAX_SYNC_TOKENS)] = Field(default_factory=list)


# After a unary turn: keep the session ("never" delete it), delete it ("always"), or delete it only once its
# sample is finished (completed or truncated: slime never resumes it), keeping pending and aborted ones.
DeleteAfterTurn = Literal["never", "always", "if_finished"]


def _present(field: str, schema: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema for "``field`` is given and not null, and matches ``schema``"."""
    return {"required": [field], "properties": {field: {"allOf": [{"not": {"type": "null"}}, schema]}}}


class TurnCreate(_Body):
    model_config = ConfigDict(
        json_schema_extra={  # the model validator, for the OpenAPI document
            "if": _present("stream", {"const": True}),
            "then": {"properties": {"delete_after_turn": {"const": "never"}}},
        }
    )

    sampling_params: SamplingParamsDict = Field(default_factory=dict)
    return_routed_experts: StrictBool | None = None
    stream: StrictBool = False
    sync: SessionSync | None = None
    delete_after_turn: DeleteAfterTurn = "never"
    resume: StrictBool | None = Field(
        None,
        description="when the engine aborts the answer mid-way (a weight update's pause), resubmit the continuation "
        "and answer one turn (docs/operations/weight-updates.md); null: the session's `resume` (off unless it was "
        "created with it). The chat routes always resume",
    )

    @model_validator(mode="after")
    def _streams_keep_their_session(self) -> TurnCreate:
        if self.stream and self.delete_after_turn != "never":
            raise ValueError("delete_after_turn is for unary turns (a streamed turn's caller may leave mid-way)")
        return self


def _unary_unsynced_schema(schema: dict[str, Any]) -> None:
    schema["properties"]["stream"] = {"type": "boolean", "const": False, "default": False}
    schema["properties"]["sync"] = {"type": "null", "default": None}


class FirstTurn(TurnCreate):
    """``POST /v1/sessions`` with ``generate``: the session and its first turn in one round trip."""

    model_config = ConfigDict(json_schema_extra=_unary_unsynced_schema)

    @model_validator(mode="after")
    def _unary_and_unsynced(self) -> FirstTurn:
        if self.stream or self.sync is not None:
            raise ValueError("the first turn of a new session is unary and has nothing to sync")
        return self


class ToolAppend(_Body):
    token_ids: TokenIds
    text: StrictStr | None = None
    sync: SessionSync | None = None


class SessionCreate(_Body):
    model_config = ConfigDict(
        json_schema_extra={  # the model validator, for the OpenAPI document
            "allOf": [
                {"if": _present("num_layers", {}), "then": _present("moe_router_topk", {})},
                {"if": _present("moe_router_topk", {}), "then": _present("num_layers", {})},
                {"if": _present("generate", {}), "then": _present("prompt_ids", {})},
            ]
        }
    )

    # an int32 array, not a Python int per token. None: a chat session, whose prompt its first chat request renders
    prompt_ids: TokenIds | None = None
    num_layers: Annotated[int, WholeNumber(gt=0, le=MAX_NUM_LAYERS)] | None = None
    moe_router_topk: Annotated[int, WholeNumber(gt=0, le=MAX_MOE_TOPK)] | None = None
    session_id: SessionId | None = None
    metadata: Metadata | None = None
    sampling_defaults: SamplingParamsDict | None = None
    # A trainer's caps on the session's chat turns (slime's max_context_tokens and max_turns_per_sid); none by default
    max_context_tokens: Annotated[int, WholeNumber(gt=0, le=INT32_MAX)] | None = Field(
        None,
        description="no branch of the session grows past this many tokens: a chat prompt over it is refused in the "
        "API's context-overflow words, an answer that would pass it is cut to what is left",
    )
    max_turns: Annotated[int, WholeNumber(gt=0, le=INT32_MAX)] | None = Field(
        None, description="model turns over all the session's branches; past it a chat request is a 429"
    )
    generate: FirstTurn | None = None  # run the first model turn at once
    resume: StrictBool = Field(
        False,
        description="the default of the session's token-level turns (`/generate`'s `resume`): resubmit an answer the "
        "engine aborts mid-way. Off by default: slime's own partial rollout resumes the drop-in's aborted samples",
    )

    @model_validator(mode="after")
    def _moe_shape_complete(self) -> SessionCreate:
        if (self.num_layers is None) != (self.moe_router_topk is None):
            raise ValueError("give both num_layers and moe_router_topk (the MoE routing shape) or neither")
        if self.generate is not None and self.prompt_ids is None:
            raise ValueError("generate needs prompt_ids (a chat session gets its prompt from its first chat request)")
        return self


MAX_CLOSE_WAIT_S = 3600


class SessionClose(_Body):
    """``POST /v1/sessions/{id}/close``: how long running turns may take to end by themselves before they are
    aborted."""

    wait_timeout_s: number(ge=0, le=MAX_CLOSE_WAIT_S) = Field(5.0, description="seconds (0: abort at once)")


class SampleBatchRequest(_Body):
    session_ids: Annotated[list[SessionId], Field(min_length=1, max_length=4096)]


Body = TypeVar("Body", bound=BaseModel)


def json_body(model: type[Body], token_array: str | None = None) -> Callable[[Request], Awaitable[Body]]:
    """A dependency that reads the body as JSON whatever its Content-Type (``curl -d`` sends a form type, and
    SGLang accepts that too), validated by pydantic's JSON parser straight from the bytes. An empty body is
    ``{}``. The body's size is bounded while it arrives (``gateway.limits``). A body over ``decode_offload_bytes``
    is validated in the worker pool, its ``token_array`` field (when given) parsed in steps that let the event loop
    run (``gateway.bodies``: pydantic holds the GIL for a whole validation)."""

    async def parse(request: Request) -> Body:
        raw = await request.body()
        state = request.app.state.gateway
        try:
            if token_array is None or len(raw) < state.settings.decode_offload_bytes:
                return await state.run_cpu(len(raw), lambda: model.model_validate_json(raw or b"{}"))
            return await state.run_cpu(len(raw), lambda: validate_big_body(model, raw, token_array))
        except ValidationError as exc:
            raise RequestValidationError(exc.errors(include_url=False)) from exc

    return parse


class AbortAll(_Body):
    """``POST /v1/abort_all``: why (each aborted turn's finish reason says it)."""

    reason: str = Field("aborted on every gateway replica", min_length=1, max_length=500)


SessionCreateBody = Annotated[SessionCreate, Depends(json_body(SessionCreate, token_array="prompt_ids"))]
TurnCreateBody = Annotated[TurnCreate, Depends(json_body(TurnCreate))]
ToolAppendBody = Annotated[ToolAppend, Depends(json_body(ToolAppend, token_array="token_ids"))]
SampleBatchBody = Annotated[SampleBatchRequest, Depends(json_body(SampleBatchRequest))]
AbortAllBody = Annotated[AbortAll, Depends(json_body(AbortAll))]
SessionCloseBody = Annotated[SessionClose, Depends(json_body(SessionClose))]
