"""Chat requests cannot stall the event loop: what a request could make the gateway do for seconds is refused first.

A 6 MB tool schema (the template would render it into the prompt, the tokenizer encode it), a 6 MB user message
(seconds of encoding for a prompt that cannot fit the context anyway) and a 17 MB body of 4,097 messages (one past
the cap) each answer 400/413 within a second while ``/health`` keeps answering, and leave the session as it was.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import orjson
import pytest
from conftest import Service

MB = 1 << 20


def new_session(gateway: Service) -> str:
    sid = f"limits-{uuid.uuid4().hex[:8]}"
    assert httpx.post(f"{gateway.url}/v1/sessions", json={"session_id": sid}).status_code == 201
    return sid


@contextmanager
def health_watch(gateway: Service) -> Iterator[list[float]]:
    """``/health``'s latencies (seconds) while the block runs, asked every 5 ms on a connection of its own."""
    latencies: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=10) as client:
            client.get(f"{gateway.url}/health")  # connected before the block starts
            while not stop.is_set():
                started = time.perf_counter()
                assert client.get(f"{gateway.url}/health").status_code == 200
                latencies.append(time.perf_counter() - started)
                time.sleep(0.005)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    time.sleep(0.05)
    try:
        yield latencies
    finally:
        stop.set()
        thread.join(10)


def tool_schema(size: int) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": "big", "parameters": {"type": "object", "description": "x" * size, "properties": {}}},
    }


CASES = {
    "6 MB tool schema": (
        {"messages": [{"role": "user", "content": "hi"}], "tools": [tool_schema(6 * MB)]},
        413,
        "tools' schemas take",
    ),
    "6 MB user message": (
        {"messages": [{"role": "user", "content": "hello world " * (MB // 2)}]},
        400,
        "maximum context length",
    ),
    "17 MB, 4,097 messages": (
        {"messages": [{"role": "user", "content": "y" * 4200} for _ in range(4097)]},
        400,
        "messages",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_request_that_would_stall_the_loop_is_refused_first(chat_gateway: Service, case: str) -> None:
    body, status, problem = CASES[case]
    raw = orjson.dumps({"model": "tiny", "max_tokens": 16, **body})
    sid = new_session(chat_gateway)
    before = httpx.get(f"{chat_gateway.url}/v1/sessions/{sid}").json()
    with health_watch(chat_gateway) as latencies:
        started = time.perf_counter()
        response = httpx.post(
            f"{chat_gateway.url}/v1/sessions/{sid}/chat/completions",
            content=raw,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        elapsed = time.perf_counter() - started
        time.sleep(0.05)
    print(f"{case}: {response.status_code} in {elapsed * 1e3:.0f} ms, /health max {max(latencies) * 1e3:.1f} ms")
    assert response.status_code == status, response.text[:500]
    assert problem in response.json()["error"]["message"]
    assert elapsed < 1.0, f"{case}: answered in {elapsed:.2f} s ({len(raw) / MB:.1f} MB)"
    # (a parse on the loop of a body this size would hold /health for seconds; 0.25 s leaves room for a loaded machine)
    assert latencies and max(latencies) < 0.25, f"{case}: /health waited up to {max(latencies) * 1e3:.0f} ms"
    after = httpx.get(f"{chat_gateway.url}/v1/sessions/{sid}").json()
    assert {k: v for k, v in after.items() if k != "updated_at"} == {
        k: v for k, v in before.items() if k != "updated_at"
    }
