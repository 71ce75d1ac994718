"""The big-body parser (``gateway.bodies``, unit tests of one layer): the same answer as pydantic's own parse for
every body, and an event loop that keeps running while a huge one is parsed in a worker thread."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import orjson
import pytest
import uvloop
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from gateway.bodies import STEP_BYTES, parse_token_array, validate_big_body
from gateway.schemas import SessionCreate, ToolAppend


def outcome(parse: Any) -> tuple[str, Any]:
    """A comparable result: the model's fields (arrays as lists), or the error locations and types."""
    try:
        model = parse()
    except ValidationError as exc:
        return "error", sorted((tuple(map(str, e["loc"])), e["type"]) for e in exc.errors())
    return "ok", {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in model.model_dump().items()}


def same_as_pydantic(raw: bytes, model: type = SessionCreate, field: str = "prompt_ids") -> tuple[str, Any]:
    fast = outcome(lambda: validate_big_body(model, raw, field))
    assert fast == outcome(lambda: model.model_validate_json(raw))
    return fast


BIG = list(range(100_000, 100_000 + 3 * STEP_BYTES // 7))  # several steps


@pytest.mark.parametrize(
    "raw",
    [
        orjson.dumps({"prompt_ids": BIG}),
        orjson.dumps({"session_id": "s", "prompt_ids": BIG, "metadata": {"k": [1, 2]}}),
        b'{ "prompt_ids" :\n [ 1 ,2,\t3 ] , "num_layers": 4, "moe_router_topk": 2}',
        # the key first appears elsewhere: inside metadata, inside a string, as another key's suffix
        orjson.dumps({"metadata": {"prompt_ids": [1, 2]}, "prompt_ids": BIG}),
        orjson.dumps({"metadata": {"note": '"prompt_ids": [9]'}, "prompt_ids": BIG}),
        b'{"a\\"prompt_ids": [1], "prompt_ids": [2, 3]}',
        b'{"prompt_ids": [1, 2], "prompt_ids": [3]}',  # a repeated key: the last wins, as in pydantic
        # invalid arrays: pydantic's own errors
        orjson.dumps({"prompt_ids": [*BIG, -1]}),
        orjson.dumps({"prompt_ids": [*BIG, 2**31]}),
        orjson.dumps({"prompt_ids": BIG})[:-2] + b",18446744073709551616]}",  # 2**64
        orjson.dumps({"prompt_ids": BIG})[:-2] + b",9223372036854775808]}",  # 2**63
        orjson.dumps({"prompt_ids": [*BIG, 1.5]}),
        orjson.dumps({"prompt_ids": [*BIG, True]}),
        orjson.dumps({"prompt_ids": [*BIG, [1]]}),
        orjson.dumps({"prompt_ids": []}),
        b'{"prompt_ids": [1, 2,]}',
        b'{"prompt_ids": [1,, 2]}',
        b'{"prompt_ids": [01]}',
        b'{"prompt_ids": [1 2]}',
        b'{"prompt_ids": [1]',
        # the rest invalid while the array is fine
        orjson.dumps({"prompt_ids": BIG, "num_layers": 4}),
        orjson.dumps({"prompt_ids": BIG, "unknown": 1}),
        orjson.dumps({"prompt_ids": BIG, "session_id": "bad id"}),
    ],
)
def test_big_bodies_parse_as_pydantic_does(raw: bytes) -> None:
    same_as_pydantic(raw)


def test_trailing_comma_at_a_step_boundary_is_refused() -> None:
    body = b"[" + b",".join(b"1234567" for _ in range(2 * STEP_BYTES // 8)) + b",]"
    assert parse_token_array(body, 0, len(body)) is None


def test_tool_tokens_take_the_same_path() -> None:
    kind, fields = same_as_pydantic(orjson.dumps({"token_ids": BIG, "text": "x"}), ToolAppend, "token_ids")
    assert kind == "ok" and fields["token_ids"] == BIG


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(-5, 2**32), max_size=50) | st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=50),
    extra=st.dictionaries(
        st.sampled_from(["session_id", "metadata", "num_layers", "moe_router_topk", "prompt_ids", "x"]),
        json_values,
        max_size=3,
    ),
    before=st.booleans(),
)
def test_any_body_parses_as_pydantic_does(ids: list[int], extra: dict[str, Any], before: bool) -> None:
    fields = {**extra, "prompt_ids": ids} if before else {"prompt_ids": ids, **extra}
    try:
        raw = orjson.dumps(fields)
    except orjson.JSONEncodeError:  # integers beyond 64 bits
        raw = b'{"prompt_ids": %s}' % orjson.dumps(ids, default=str)
    same_as_pydantic(raw)


def test_the_event_loop_runs_while_a_huge_body_is_parsed() -> None:
    """4M token ids (~31 MB): pydantic alone holds the GIL for the whole parse (~0.3 s here), stalling the loop as
    long even from a worker thread; parsed in steps, the loop keeps ticking."""
    raw = orjson.dumps({"prompt_ids": list(range(1_000_000, 5_000_000))})

    async def largest_loop_gap() -> float:
        gaps: list[float] = []

        async def tick() -> None:
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.05)
        with ThreadPoolExecutor(1) as pool:
            model = await asyncio.get_running_loop().run_in_executor(
                pool, validate_big_body, SessionCreate, raw, "prompt_ids"
            )
        ticker.cancel()
        assert len(model.prompt_ids) == 4_000_000 and model.prompt_ids.dtype == np.int32
        return max(gaps)

    gap = uvloop.run(largest_loop_gap())  # the gateway's loop
    print(f"largest event-loop gap while parsing {len(raw) / 1e6:.0f} MB: {gap * 1000:.1f} ms")
    assert gap < 0.05
