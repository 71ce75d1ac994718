"""Fault injection: a FIFO of faults, each applied to the next N /generate calls (one fault per call).

`POST /sim/faults {"mode": M, "count": N = 1 (-1: until DELETE /sim/faults), "delay_s": s, "after_tokens": K}`.
Modes:

answer faults (a correct answer, then corrupted; in a stream they hit the chunks that carry the key):
  bad_base64        routed_experts is not valid base64
  drop_routing      routed_experts missing although asked for (what a stripping router does)
  drop_top_p        top_p_token_ids / top_p_token_offsets missing although asked for
  ignore_start_len  routing rows from position 0, as if routed_experts_start_len were ignored
  wrong_rows        one routing row too few
  bad_offsets       top-p offsets[-1] != len(ids)
  missing_logprobs  no output_token_logprobs
  null_logprob      the first log-prob is null
  bad_weight_versions  the last weight_versions span ends one past the generated tokens
transport faults (the app acts on them by name):
  http_500 / http_400 / http_503   that status with {"error": {"message": ...}} instead of an answer
  delay             sleep delay_s (default 1 s) before answering: for client timeouts
  cut_stream        stream: two chunks, then the connection drops without [DONE];
                    non-stream: half the announced body, then the connection drops
  malformed_json    200 with truncated JSON (stream: the first event's JSON is cut)
  stream_error      stream: two chunks, then an in-band {"error": ...} event and [DONE]; non-stream: 500
  abort             finish with type "abort" after half the tokens
  hold              generate the first after_tokens (K) tokens (a stream sends them), then hold: nothing more until
                    POST /continue_generation (it goes on) or an abort (/abort_request, /pause_generation in its
                    abort mode: it ends there, with exactly K tokens). A weight update's landing point, made exact:
                    the tests hold an answer at token K, then drive slime's pause -> update -> continue
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from .engine import NO_DISTORTION, Distortion

_TOP_P_KEYS = frozenset({"top_p_token_ids", "top_p_token_offsets"})

DISTORTIONS: dict[str, Distortion] = {
    "bad_base64": Distortion(garble_routing=True),
    "drop_routing": Distortion(drop_keys=frozenset({"routed_experts"})),
    "drop_top_p": Distortion(drop_keys=_TOP_P_KEYS),
    "ignore_start_len": Distortion(routing_from_zero=True),
    "wrong_rows": Distortion(routing_rows_delta=-1),
    "bad_offsets": Distortion(garble_offsets=True),
    "missing_logprobs": Distortion(drop_keys=frozenset({"output_token_logprobs"})),
    "null_logprob": Distortion(null_first_logprob=True),
    "bad_weight_versions": Distortion(garble_weight_versions=True),
}

# Status code and error message of the faults that answer with an HTTP error instead of generating.
HTTP_ERRORS: dict[str, tuple[int, str]] = {
    "http_500": (500, "simulated internal error"),
    "http_400": (400, "simulated bad request"),
    "http_503": (503, "simulated overload: service unavailable"),
}

TRANSPORT_MODES = frozenset({"delay", "cut_stream", "malformed_json", "abort", "stream_error", "hold"})
FAULT_MODES = frozenset(DISTORTIONS) | frozenset(HTTP_ERRORS) | TRANSPORT_MODES
DEFAULT_DELAY_S = 1.0


@dataclass
class Fault:
    mode: str
    remaining: int  # calls still to hit; -1 = until cleared
    delay_s: float = 0.0
    after_tokens: int | None = None  # hold: where the answer stops until continued

    @property
    def distortion(self) -> Distortion:
        return DISTORTIONS.get(self.mode, NO_DISTORTION)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_fault(body: Any) -> Fault:
    """Validate a `POST /sim/faults` body: {"mode": M, "count": N = 1 (-1 = until cleared), "delay_s": s,
    "after_tokens": K (hold only, required there)}."""
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    mode = body.get("mode")
    if mode not in FAULT_MODES:
        raise ValueError(f"unknown fault mode {mode!r}; known: {sorted(FAULT_MODES)}")
    count = body.get("count", 1)
    if type(count) is not int or (count < 1 and count != -1):
        raise ValueError("count must be a positive int or -1 (until cleared)")
    delay = body.get("delay_s", DEFAULT_DELAY_S if mode == "delay" else 0.0)
    if isinstance(delay, bool) or not isinstance(delay, (int, float)) or delay < 0:
        raise ValueError("delay_s must be a number >= 0")
    after = body.get("after_tokens")
    if (mode == "hold") != (after is not None) or (after is not None and (type(after) is not int or after < 0)):
        raise ValueError('after_tokens (an int >= 0) is what "hold" needs, and only "hold" takes it')
    return Fault(mode, count, float(delay), after)


class FaultQueue:
    """Faults waiting to hit /generate calls, first queued first applied; one fault per call."""

    def __init__(self) -> None:
        self._queue: deque[Fault] = deque()

    def push(self, fault: Fault) -> None:
        self._queue.append(fault)

    def clear(self) -> int:
        cleared = len(self._queue)
        self._queue.clear()
        return cleared

    def pending(self) -> list[dict[str, Any]]:
        return [f.to_dict() for f in self._queue]

    def take(self) -> Fault | None:
        """The fault for the current call, if any; counts it down and retires it when spent."""
        if not self._queue:
            return None
        head = self._queue[0]
        if head.remaining > 0:
            head.remaining -= 1
            if head.remaining == 0:
                self._queue.popleft()
        return Fault(head.mode, 1, head.delay_s, head.after_tokens)
