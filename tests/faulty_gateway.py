"""The real gateway process (``python -m gateway``'s ``main``) with two bugs planted, for the 500 tests:

    python tests/faulty_gateway.py --upstream-url URL --port P

- ``GET /test/crash`` is a FastAPI route that raises ``RuntimeError``;
- the passthrough ``GET /get_server_info`` fails inside ``Upstream.forward`` with ``RuntimeError`` (the other
  passthrough routes work).

Both messages carry a "secret" that must never reach the caller. Everything else is the gateway as shipped.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

import gateway.__main__ as gateway_main
from gateway.app import create_app
from gateway.upstream import Upstream

SECRET = "secret-internal-detail-/etc/gateway"
_forward = Upstream.forward


def create_app_with_a_crashing_route(*args: Any, **kwargs: Any) -> FastAPI:
    app = create_app(*args, **kwargs)

    @app.get("/test/crash")
    async def crash() -> None:
        raise RuntimeError(SECRET)

    return app


async def forward_failing_for_server_info(self: Upstream, method: str, target: bytes, *args: Any, **kwargs: Any) -> Any:
    if target.startswith(b"/get_server_info"):
        raise RuntimeError(SECRET)
    return await _forward(self, method, target, *args, **kwargs)


if __name__ == "__main__":
    gateway_main.create_app = create_app_with_a_crashing_route  # type: ignore[assignment]
    Upstream.forward = forward_failing_for_server_info  # type: ignore[method-assign]
    gateway_main.main()
