"""Request bodies of the v1 API (pydantic, strict where a silent coercion would corrupt a sample)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, model_validator

TokenId = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]
SessionId = Annotated[StrictStr, Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:@-]+$")]


class _Body(BaseModel):
    # Unknown fields are errors: a misspelt "return_routed_expert" must not silently train without replay.
    model_config = ConfigDict(extra="forbid")


class SessionCreate(_Body):
    prompt_ids: Annotated[list[TokenId], Field(min_length=1)]
    num_layers: Annotated[StrictInt, Field(gt=0)] | None = None
    moe_router_topk: Annotated[StrictInt, Field(gt=0)] | None = None
    session_id: SessionId | None = None
    metadata: dict[str, Any] | None = None
    sampling_defaults: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _moe_shape_complete(self) -> SessionCreate:
        if (self.num_layers is None) != (self.moe_router_topk is None):
            raise ValueError("give both num_layers and moe_router_topk (the MoE routing shape) or neither")
        return self


class TurnCreate(_Body):
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    return_routed_experts: StrictBool | None = None
    stream: StrictBool = False

    @model_validator(mode="after")
    def _custom_params_is_object(self) -> TurnCreate:
        custom = self.sampling_params.get("custom_params")
        if custom is not None and not isinstance(custom, dict):
            raise ValueError("sampling_params.custom_params must be an object")
        return self


class ToolAppend(_Body):
    token_ids: Annotated[list[TokenId], Field(min_length=1)]
    text: StrictStr | None = None


class SampleBatchRequest(_Body):
    session_ids: Annotated[list[SessionId], Field(min_length=1, max_length=4096)]


Body = TypeVar("Body", bound=BaseModel)


def json_body(model: type[Body]) -> Callable[[Request], Awaitable[Body]]:
    """A dependency that reads the body as JSON whatever its Content-Type (``curl -d`` sends a form type, and
    SGLang accepts that too), validated by pydantic's JSON parser straight from the bytes. An empty body is
    ``{}``."""

    async def parse(request: Request) -> Body:
        raw = await request.body()
        try:
            return model.model_validate_json(raw or b"{}")
        except ValidationError as exc:
            raise RequestValidationError(exc.errors(include_url=False)) from exc

    return parse


SessionCreateBody = Annotated[SessionCreate, Depends(json_body(SessionCreate))]
TurnCreateBody = Annotated[TurnCreate, Depends(json_body(TurnCreate))]
ToolAppendBody = Annotated[ToolAppend, Depends(json_body(ToolAppend))]
SampleBatchBody = Annotated[SampleBatchRequest, Depends(json_body(SampleBatchRequest))]
