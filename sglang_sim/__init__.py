"""An SGLang-protocol simulator: a stand-in SGLang worker for tests, demos and benchmarks.

Speaks docs/protocol.md sections 1-4 (same keys, encodings, cumulative SSE, abort, errors) with a configurable MoE
shape, latency and fault injection, deterministic from a seed. A package of its own beside the gateway, which never
imports it (nor does it import the gateway), so it can stand in for SGLang anywhere.

    python -m sglang_sim --port 30000 --num-layers 48 --topk 8 --num-experts 128

In-process: `create_app(SimulatorConfig(...))` returns the ASGI app.
"""

from .app import Simulator, create_app
from .engine import SimulatorConfig

__all__ = ["Simulator", "SimulatorConfig", "create_app"]
