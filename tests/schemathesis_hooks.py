"""Schemathesis hooks for tests/test_openapi.py (loaded through SCHEMATHESIS_HOOKS).

A session's MoE shape (``num_layers``, ``moe_router_topk``) must be the served model's: the gateway cannot tell a
session declaring another model's shape from an upstream answering with rows of the wrong size, so the first model
turn of such a session is a 502 ``upstream_protocol_error`` (nothing changed). The document cannot say which shape
the upstream serves, so generated sessions with a valid shape are given the simulator's: every generated turn then
reaches the fold. Invalid shapes (negative data) are left as they are, to be refused.
"""

from __future__ import annotations

import os
from typing import Any

import schemathesis

SIM_SHAPE = (int(os.environ.get("SIM_LAYERS", "4")), int(os.environ.get("SIM_TOPK", "2")))
MAX_NUM_LAYERS, MAX_MOE_TOPK = 1024, 256


def _valid(value: Any, most: int) -> bool:
    return type(value) in (int, float) and float(value).is_integer() and 0 < value <= most


@schemathesis.hook
def map_body(ctx: schemathesis.HookContext, body: Any) -> Any:
    shaped = isinstance(body, dict) and _valid(body.get("num_layers"), MAX_NUM_LAYERS)
    if shaped and _valid(body.get("moe_router_topk"), MAX_MOE_TOPK):
        body["num_layers"], body["moe_router_topk"] = SIM_SHAPE
    return body
