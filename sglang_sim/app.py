"""The simulator's HTTP face: SGLang's worker protocol (docs/protocol.md sections 1-4) plus /sim/ test controls.

Request flow for `POST /generate`: log the request, take the next queued fault, validate, then either
- non-streaming: pace each prompt (latency + token delay, cut short by an abort or a client disconnect),
  build the final answer (off the event loop when it is big) and send it in one response; or
- streaming: an async generator paces and yields cumulative SSE chunks; `_EventStream` sends them, watches
  for the client going away, and can leave the response unfinished to simulate a dropped connection.

Scripted answers: `POST /sim/script` with `{"rid_prefix": P, "answers": [A, ...]}` queues answers for the rids
that start with P (appended to any already queued for P). Each A is `{"text": "..."}` (encoded with the simulator's
tokenizer, no special tokens added; a 400 without `--tokenizer`) or `{"token_ids": [...]}` (ids in [0, vocab size),
used as given), optionally with `"eos": false` (by default the eos id is appended, so the answer ends like a random
one that stops: `{"type": "stop", "matched": eos}`). A prompt whose rid starts with a queued prefix (the longest one
wins; "" matches every rid) takes that prefix's next answer, first in first out. Its tokens replace the random draw
and everything else (log-probs, routing, top-p, weight versions, prefix cache, stream chunks, abort, faults,
stop_token_ids) works on them as on random ones. Longer than max_new_tokens: cut to it, `{"type": "length", ...}`;
without eos and shorter: `{"type": "stop", "matched": null}` (see `engine.scripted_tokens`). A request failed by an
HTTP-error fault or a 400 takes no answer, so its retry gets it. `GET /sim/script` lists what is queued per prefix,
`DELETE /sim/script` and `POST /sim/reset` clear it.

SGLang's weight-update protocol, as slime drives it (pause -> flush_cache -> update -> continue):
`POST /pause_generation {"mode": "abort" | "retract" | "in_place"}` (default abort) and `POST /continue_generation`.
While paused, a new `/generate` waits before it starts (SGLang's tokenizer manager holds it on `is_pause`; it is not
refused) and an abort still reaches it (it ends with no tokens). `abort`: every running answer ends at once with
`finish_reason.type == "abort"` and its output so far (the pause answers once they have ended); `retract` and
`in_place`: running answers stop where they are and go on after continue (`retract` counts it in
`meta_info.num_retractions`); `flush_cache` fails (400) while an `in_place` pause keeps answers running, as SGLang's.
A weight update while paused (`POST /update_weight_version {"new_version": V}`, SGLang's route, which also aborts
the running answers unless `"abort_all_requests": false`; or `/sim/weight_version`) is the version the answers go on
with: their `weight_versions` spans switch where they paused. An answer aborted part-way is resumed by a request
whose input is its prompt plus the tokens it had (engine `Continuation`): that request goes on with the rest of the
same answer. The `hold` fault stops an answer at an exact token until continue (or an abort), so tests can land the
pause on token K; `GET /sim/stats` counts the answers `held` there or paused, the requests `waiting` to start, and
the pause `mode` (null when running).

All state lives in one `Simulator` object per app (scripts included); nothing is module-global.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from .engine import (
    ABORT_FINISH,
    BadRequest,
    Engine,
    Generation,
    GenItem,
    ScriptBook,
    SimulatorConfig,
    WeightUpdate,
    nesting_depth,
    parse_generate,
    parse_script,
    parse_weight_update,
)
from .faults import HTTP_ERRORS, Fault, FaultQueue, parse_fault

REQUEST_LOG_SIZE = 200
# Answers with more elements than this are built in a worker thread so /health and aborts stay responsive.
OFFLOAD_ELEMENTS = 1 << 20
CUT_AFTER_CHUNKS = 2  # stream faults let this many chunks through first
DONE_EVENT = (b"data: [DONE]\n\n",)
JSON = "application/json"
_INVALID = object()  # marks a body that is not JSON
PAUSE_MODES = ("abort", "retract", "in_place")
# How long `/pause_generation` in its abort mode waits for the aborted answers to end (SGLang polls until none runs).
PAUSE_DRAIN_S = 5.0


@dataclass
class Stats:
    requests: int = 0  # /generate calls
    items: int = 0  # prompts started (each prompt of a batch counts)
    completed: int = 0
    aborted: int = 0  # by /abort_request or the abort fault
    disconnected: int = 0  # the client went away first
    generated_tokens: int = 0
    errors: int = 0  # 4xx/5xx answers from /generate
    faults_applied: int = 0
    scripted: int = 0  # prompts answered from /sim/script
    resumed: int = 0  # prompts that resumed an aborted answer (engine.Continuation)


class _Running:
    """A prompt being generated (or waiting for a pause to end before it starts): what /abort_request, a
    disconnect, a pause and a continue signal."""

    def __init__(self, rid: str, hold_at: int | None = None) -> None:
        self.rid = rid
        self.wake = asyncio.Event()  # set by an abort, a disconnect, a pause, a continue
        self.aborted = False
        self.disconnected = False
        self.released = False  # a continue came while it waited
        self.hold_at = hold_at  # the hold fault: stop after this many tokens until continued
        self.gen: Generation | None = None  # once started

    @property
    def stopped(self) -> bool:
        return self.aborted or self.disconnected

    def abort(self) -> None:
        self.aborted = True
        self.wake.set()

    def disconnect(self) -> None:
        self.disconnected = True
        self.wake.set()

    def nudge(self) -> None:
        self.wake.set()

    def release(self) -> None:
        self.released = True
        self.wake.set()

    async def sleep(self, seconds: float) -> bool:
        """Sleep like a model generating; False as soon as it is stopped (aborted, its client gone) or nudged (a
        pause: the caller looks at what changed)."""
        if self.stopped:
            return False
        if seconds <= 0:
            return True
        try:
            await asyncio.wait_for(self.wake.wait(), seconds)
        except TimeoutError:
            return True
        if not self.stopped:
            self.wake.clear()
        return False

    async def wait_for_continue(self) -> bool:
        """Until a continue releases it (True) or it is stopped (False)."""
        self.released = False
        while not self.stopped and not self.released:
            await self.wake.wait()
            if not self.stopped:
                self.wake.clear()
        return not self.stopped


async def _watch_disconnect(receive: Receive, runs: Iterable[_Running]) -> None:
    """The request body is already read, so the next ASGI message is the client going away."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            for run in runs:
                run.disconnect()
            return


# An SSE event as the pieces it is sent in. A final chunk is ~20 MB: it goes as prefix, JSON, blank line, since
# joining them would copy it once more on top of the copy the ASGI server makes to frame it as an HTTP chunk;
# smaller events are joined (each piece costs a trip through the ASGI stack and a write).
Event = tuple[bytes, ...]
JOIN_EVENTS_BELOW = 1 << 20


def _sse(obj: Any) -> Event:
    payload = orjson.dumps(obj)
    if len(payload) < JOIN_EVENTS_BELOW:
        return (b"data: %b\n\n" % payload,)
    return (b"data: ", payload, b"\n\n")


def _hold_at(fault: Fault | None) -> int | None:
    return fault.after_tokens if fault is not None and fault.mode == "hold" else None


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type=JSON)


def _error(status: int, message: str) -> Response:
    return _json({"error": {"message": message}}, status)


def _loads(raw: bytes) -> Any:
    try:
        return orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        return _INVALID


def _new_rid() -> str:
    return uuid.uuid4().hex


def _summarize(body: Any) -> Any:
    """The logged body: prompts replaced by their lengths, so 200 logged requests stay small."""
    if not isinstance(body, dict):
        return None
    out = dict(body)
    for key, new_key, batch_depth in (("input_ids", "input_len", 2), ("input_embeds", "input_embeds_len", 3)):
        if key in out:
            out[new_key] = _prompt_lengths(out.pop(key), batch_depth)
    return out


def _prompt_lengths(value: Any, batch_depth: int) -> int | list[int] | None:
    if not isinstance(value, list):
        return None
    if nesting_depth(value) >= batch_depth:
        return [len(v) if isinstance(v, list) else 0 for v in value]
    return len(value)


async def _one_shot(events: list[Event]) -> AsyncGenerator[Event | None, None]:
    for event in events:
        yield event


class _EventStream(Response):
    """An SSE response fed by an async generator; a `None` event drops the connection (cut_stream fault)."""

    def __init__(self, events: AsyncGenerator[Event | None, None], run: _Running | None) -> None:
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        self._events = events
        self._run = run

    def _gone(self) -> bool:
        return self._run is not None and self._run.disconnected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.create_task(_watch_disconnect(receive, [self._run] if self._run else []))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in self._events:
                if event is None or self._gone():
                    return  # an unfinished response makes the server close the connection
                for piece in event:
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            await self._events.aclose()


class _CutResponse(Response):
    """Announces the full body, sends half of it and stops: the client sees the connection drop mid-body."""

    def __init__(self, body: bytes) -> None:
        self.status_code = 200
        self.background = None
        self.body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", JSON.encode()), (b"content-length", str(len(self.body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": self.body[: len(self.body) // 2], "more_body": True})


class Simulator:
    """One simulated SGLang worker: engine, fault queue, request log, stats and the running requests."""

    def __init__(self, config: SimulatorConfig) -> None:
        self.config = config
        self.engine = Engine(config)
        self.faults = FaultQueue()
        self.scripts = ScriptBook()
        self.requests: deque[dict[str, Any]] = deque(maxlen=REQUEST_LOG_SIZE)
        self.stats = Stats()
        self._running: dict[str, set[_Running]] = {}
        self.pause_mode: str | None = None  # SGLang's is_pause, with the mode it was paused in
        self._waiting: set[_Running] = set()  # held, paused, or not started because of a pause

    def routes(self) -> list[Route]:
        return [
            Route("/generate", self.generate, methods=["POST"]),
            Route("/abort_request", self.abort_request, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/health_generate", self.health, methods=["GET"]),
            Route("/get_model_info", self.model_info, methods=["GET"]),
            Route("/model_info", self.model_info, methods=["GET"]),
            Route("/get_server_info", self.server_info, methods=["GET"]),
            Route("/server_info", self.server_info, methods=["GET"]),
            Route("/flush_cache", self.flush_cache, methods=["GET", "POST"]),
            Route("/pause_generation", self.pause_generation, methods=["POST"]),
            Route("/continue_generation", self.continue_generation, methods=["POST"]),
            Route("/update_weight_version", self.update_weight_version, methods=["POST"]),
            Route("/v1/loads", self.loads, methods=["GET"]),
            Route("/sim/faults", self.sim_faults, methods=["GET", "POST", "DELETE"]),
            Route("/sim/requests", self.sim_requests, methods=["GET", "DELETE"]),
            Route("/sim/stats", self.sim_stats, methods=["GET"]),
            Route("/sim/reset", self.sim_reset, methods=["POST"]),
            Route("/sim/weight_version", self.sim_weight_version, methods=["POST"]),
            Route("/sim/script", self.sim_script, methods=["GET", "POST", "DELETE"]),
        ]

    # ------------------------------------------------------------------------------------- /generate

    async def generate(self, request: Request) -> Response:
        started = time.perf_counter()
        raw = await request.body()
        self.stats.requests += 1
        body = _loads(raw)
        self.requests.append(
            {"path": request.url.path, "headers": dict(request.headers), "body": _summarize(body), "bytes": len(raw)}
        )
        fault = self.faults.take()
        if fault is not None:
            self.stats.faults_applied += 1
            failed = await self._early_fault(fault)
            if failed is not None:
                return failed
        if body is _INVALID:
            return self._failed(400, "request body is not valid JSON")
        try:
            req = parse_generate(body, self.config, self.engine.vocab, _new_rid)
        except BadRequest as exc:
            if isinstance(body, dict) and body.get("stream") is True:
                # SGLang validates inside the stream: the error arrives in-band with HTTP 200.
                self.stats.errors += 1
                error = _sse(
                    {"error": {"message": str(exc), "type": "invalid_request_error", "code": 400, "retryable": False}}
                )
                return _EventStream(_one_shot([error, DONE_EVENT]), None)
            return self._failed(400, str(exc))
        if req.stream:
            return self._stream(req.items[0], fault, started)
        return await self._complete(request, req.items, req.batch, fault, started)

    def _failed(self, status: int, message: str) -> Response:
        self.stats.errors += 1
        return _error(status, message)

    async def _early_fault(self, fault: Fault) -> Response | None:
        """Faults that act before generation: a delay, or an HTTP error instead of an answer."""
        if fault.mode == "delay":
            await asyncio.sleep(fault.delay_s)
        if fault.mode in HTTP_ERRORS:
            return self._failed(*HTTP_ERRORS[fault.mode])
        return None

    async def _complete(
        self, request: Request, items: tuple[GenItem, ...], batch: bool, fault: Fault | None, started: float
    ) -> Response:
        if fault is not None and fault.mode == "stream_error":
            return self._failed(500, "simulated stream error")  # what a non-streamed call sees instead
        runs = [_Running(item.rid, _hold_at(fault)) for item in items]
        watcher = asyncio.create_task(_watch_disconnect(request.receive, runs))
        try:
            parts = await asyncio.gather(
                *(self._run_item(item, run, fault, started) for item, run in zip(items, runs, strict=True))
            )
        finally:
            watcher.cancel()
        body = b"[" + b",".join(parts) + b"]" if batch else parts[0]
        mode = fault.mode if fault else None
        if mode == "malformed_json":
            return Response(body[: len(body) // 2], media_type=JSON)
        if mode == "cut_stream":
            return _CutResponse(body)
        return Response(body, media_type=JSON)

    async def _run_item(self, item: GenItem, run: _Running, fault: Fault | None, started: float) -> bytes:
        self._register(run)
        try:
            admitted = await self._admitted(run)  # False: aborted while a pause held it back (no tokens)
            gen = self._start(item, fault, run)
            m = await self._pace(run, gen.n) if admitted else 0
            aborted = m < gen.n or (not admitted) or (gen.n == 0 and run.stopped)
        finally:
            self._unregister(run)
        if fault is not None and fault.mode == "abort":
            m, aborted = gen.n // 2, True
        finish = ABORT_FINISH if aborted else gen.plan.finish
        try:
            (body,) = await self._build(gen, m, finish, started, sse=False)
            return body
        finally:
            self._finish(gen, m, aborted, run.disconnected)

    async def _admitted(self, run: _Running) -> bool:
        """A request that arrives while the engine is paused waits (SGLang holds it, it does not refuse it) until
        continue; False when it was aborted (or its client left) meanwhile."""
        if self.pause_mode is None:
            return True
        self._waiting.add(run)
        try:
            return await run.wait_for_continue()
        finally:
            self._waiting.discard(run)

    async def _pace(self, run: _Running, n: int) -> int:
        """A unary answer's `n` tokens, paced (the latency first); how many there are when it ends."""
        if not await run.sleep(self.config.latency_ms / 1000) and run.stopped:
            return 0
        m = 0
        while m < n and not run.stopped:
            m = await self._advance(run, m, n)
        return m

    async def _advance(self, run: _Running, m: int, target: int) -> int:
        """Generate from `m` tokens towards `target`, paced like a model; a pause in place or retract, or the hold
        point, is waited out first (until continue). Returns at `target`, at the hold point (so that a stream sends
        the tokens up to it before it holds), or where it was stopped (aborted, its client gone)."""
        per_token = self.config.token_delay_ms / 1000
        while m < target and not run.stopped:
            if self.pause_mode is not None or (run.hold_at is not None and m >= run.hold_at):
                await self._hold(run, m)
                continue
            step = target if run.hold_at is None else min(target, run.hold_at)
            t0 = time.perf_counter()
            if await run.sleep((step - m) * per_token):
                m = step
                if m == run.hold_at:
                    return m
            elif per_token > 0:  # stopped or paused part-way: the tokens done by then
                done = int((time.perf_counter() - t0) / per_token)
                m = max(m, min(m + done, step - 1))
        return m

    async def _hold(self, run: _Running, m: int) -> None:
        """Generate nothing until a continue (the hold point reached, or a pause in place or retract): then go on
        from `m` on the weights of that moment."""
        self._waiting.add(run)
        try:
            released = await run.wait_for_continue()
        finally:
            self._waiting.discard(run)
        if released:
            run.hold_at = None
            if run.gen is not None:
                run.gen.continue_on(m, self.engine.weight_version)

    # ------------------------------------------------------------------------------------- streaming

    def _stream(self, item: GenItem, fault: Fault | None, started: float) -> Response:
        run = _Running(item.rid, _hold_at(fault))
        return _EventStream(self._events(item, run, fault, started), run)

    async def _events(
        self, item: GenItem, run: _Running, fault: Fault | None, started: float
    ) -> AsyncGenerator[Event | None, None]:
        """Cumulative chunks paced like token generation, then the final chunk and [DONE]."""
        cfg = self.config
        mode = fault.mode if fault else None
        self._register(run)
        try:
            admitted = await self._admitted(run)
        except BaseException:
            self._unregister(run)
            raise
        gen = self._start(item, fault, run)
        stop_at = gen.n // 2 if mode == "abort" else gen.n
        m, sent, aborted = 0, 0, not admitted
        try:
            if admitted and not await run.sleep(cfg.latency_ms / 1000) and run.stopped:
                aborted = True
            while not aborted and m < stop_at:
                target = min(m + cfg.stream_chunk_tokens, stop_at)
                reached = await self._advance(run, m, target)
                if run.stopped:  # the tokens of the chunk it was in are not counted
                    aborted = True
                    break
                if mode in ("cut_stream", "stream_error") and (sent >= CUT_AFTER_CHUNKS or reached == stop_at):
                    for event in self._broken_ending(mode):
                        yield event
                    return
                m = reached
                if m == stop_at:
                    break  # the last tokens travel with the final chunk
                yield self._maybe_malformed(_sse(gen.chunk(m, first=sent == 0)), mode, sent)
                sent += 1
                if cfg.token_delay_ms == 0:
                    await asyncio.sleep(0)  # let aborts and disconnects in between chunks
            if run.disconnected:
                return
            aborted = aborted or m < gen.n
            final = await self._build(gen, m, ABORT_FINISH if aborted else gen.plan.finish, started, sse=True)
            yield self._maybe_malformed(final, mode, sent)
            yield DONE_EVENT
        finally:
            self._unregister(run)
            self._finish(gen, m, aborted, run.disconnected)

    @staticmethod
    def _maybe_malformed(event: Event, mode: str | None, sent: int) -> Event:
        """The malformed_json fault in a stream: the first event's JSON is cut in half."""
        if mode == "malformed_json" and sent == 0:
            whole = b"".join(event)
            return (whole[: len(whole) // 2] + b"\n\n",)
        return event

    @staticmethod
    def _broken_ending(mode: str) -> list[Event | None]:
        if mode == "cut_stream":
            return [None]
        return [_sse({"error": {"message": "simulated stream error", "code": 500}}), DONE_EVENT]

    # --------------------------------------------------------------------------------- shared steps

    def _start(self, item: GenItem, fault: Fault | None, run: _Running) -> Generation:
        """The answer starts: the rest of an aborted one it resumes, else a scripted or a random one."""
        continuation = self.engine.take_continuation(item)
        script = None if continuation is not None else self.scripts.take(item.rid)
        gen = self.engine.start(item, script, continuation)
        if fault is not None:
            gen.distortion = fault.distortion
        run.gen = gen
        self.stats.items += 1
        self.stats.scripted += script is not None
        self.stats.resumed += continuation is not None
        return gen

    async def _build(self, gen: Generation, m: int, finish: dict[str, Any], started: float, *, sse: bool) -> Event:
        """The final answer, as the pieces it is sent in (one when it is not streamed)."""
        e2e = time.perf_counter() - started

        def build() -> Event:
            answer = gen.final(m, finish, e2e, streamed=sse)
            return _sse(answer) if sse else (orjson.dumps(answer),)

        if gen.payload_size(m) > OFFLOAD_ELEMENTS:
            return await asyncio.to_thread(build)
        return build()

    def _finish(self, gen: Generation, m: int, aborted: bool, disconnected: bool) -> None:
        self.engine.cache.insert(gen.fed_sequence(m))
        self.stats.generated_tokens += m
        if disconnected:
            self.stats.disconnected += 1
        elif aborted:
            self.stats.aborted += 1
            self.engine.note_abort(gen, m)
        else:
            self.stats.completed += 1

    def _register(self, run: _Running) -> None:
        self._running.setdefault(run.rid, set()).add(run)

    def _unregister(self, run: _Running) -> None:
        runs = self._running.get(run.rid)
        if runs is not None:
            runs.discard(run)
            if not runs:
                del self._running[run.rid]

    # ------------------------------------------------------------------------------ SGLang control

    async def abort_request(self, request: Request) -> Response:
        body = _loads(await request.body())
        if isinstance(body, dict):
            for run in self._abort_targets(body):
                run.abort()
        return Response(status_code=200)  # SGLang answers 200 whether or not the rid was running

    def _abort_targets(self, body: dict[str, Any]) -> list[_Running]:
        if body.get("abort_all"):
            rids: Iterable[Any] = list(self._running)
        else:
            rid = body.get("rid")
            rids = rid if isinstance(rid, list) else [rid]
        return [run for rid in rids if isinstance(rid, str) for run in self._running.get(rid, ())]

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    def _shape(self) -> dict[str, Any]:
        cfg, vocab = self.config, self.engine.vocab
        return {
            "num_layers": cfg.num_layers,
            "num_hidden_layers": cfg.num_layers,
            "topk": cfg.topk,
            "num_experts_per_tok": cfg.topk,
            "num_experts": cfg.num_experts,
            "vocab_size": vocab.size,
            "eos_token_id": vocab.eos,
        }

    async def model_info(self, request: Request) -> Response:
        info = {
            "model_path": None,
            "tokenizer_path": self.config.tokenizer,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.engine.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "sim_moe",
            "architectures": ["SimulatorMoeForCausalLM"],
        }
        return _json({**info, **self._shape()})

    async def server_info(self, request: Request) -> Response:
        cfg = self.config
        info = {
            "model_path": None,
            "tokenizer_path": cfg.tokenizer,
            "version": "sim",
            "simulator": True,
            "enable_return_routed_experts": cfg.enable_routed_experts,
            "seed": cfg.seed,
            "weight_version": self.engine.weight_version,
            "latency_ms": cfg.latency_ms,
            "token_delay_ms": cfg.token_delay_ms,
            "stream_chunk_tokens": cfg.stream_chunk_tokens,
            "default_max_new_tokens": cfg.default_max_new_tokens,
        }
        return _json({**info, **self._shape()})

    async def flush_cache(self, request: Request) -> Response:
        if self.pause_mode == "in_place" and any(run.gen is not None for run in self._waiting):
            # SGLang: an in-place pause keeps the answers in the running batch, whose cache cannot be flushed
            return Response("Cache not flushed. Please check server log.\n", status_code=400, media_type="text/plain")
        self.engine.cache.clear()
        return Response("Cache flushed.\n", media_type="text/plain")

    # ------------------------------------------------------------------ weight updates (slime's sequence)

    async def pause_generation(self, request: Request) -> Response:
        body = _loads(await request.body())
        mode = body.get("mode", "abort") if isinstance(body, dict) else "abort" if body is None else None
        if mode not in PAUSE_MODES:
            return _error(400, f"mode must be one of {', '.join(PAUSE_MODES)} (got {mode!r})")
        self.pause_mode = mode
        started = [run for runs in self._running.values() for run in runs if run.gen is not None]
        if mode == "abort":
            for run in started:
                run.abort()
            await self._drained(started)
        else:
            for run in started:
                if mode == "retract" and run.gen is not None:
                    run.gen.retractions += 1
                run.nudge()  # it stops at its next step and waits for continue
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    async def _drained(self, runs: list[_Running]) -> None:
        deadline = time.perf_counter() + PAUSE_DRAIN_S
        while any(run in self._running.get(run.rid, ()) for run in runs) and time.perf_counter() < deadline:
            await asyncio.sleep(0.005)

    async def continue_generation(self, request: Request) -> Response:
        """The pause ends: paused answers go on, held ones too, and requests that waited start."""
        self.pause_mode = None
        for run in list(self._waiting):
            run.release()
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    async def update_weight_version(self, request: Request) -> Response:
        """SGLang's `/update_weight_version {"new_version": V, "abort_all_requests": true}`: the version the answers
        from now on carry (running ones abort first unless `abort_all_requests` is false)."""
        body = _loads(await request.body())
        version = body.get("new_version") if isinstance(body, dict) else None
        if not isinstance(version, str) or not version:
            return _error(400, 'body must be {"new_version": "<non-empty string>", "abort_all_requests": <bool>}')
        if body.get("abort_all_requests", True):
            for runs in list(self._running.values()):
                for run in runs:
                    run.abort()
        self.engine.update_weights(WeightUpdate(version))
        return _json({"success": True, "message": f"Weight version updated to {version}", "new_version": version})

    def _running_count(self) -> int:
        return sum(len(runs) for runs in self._running.values())

    async def loads(self, request: Request) -> Response:
        """SGLang 0.5's shape: one entry per data-parallel rank (the simulator has one)."""
        load = {"dp_rank": 0, "num_running_reqs": self._running_count(), "num_waiting_reqs": 0, "num_used_tokens": 0}
        return _json({"version": "sim", "loads": [load]})

    # --------------------------------------------------------------------------------- /sim/ controls

    async def sim_faults(self, request: Request) -> Response:
        if request.method == "DELETE":
            return _json({"cleared": self.faults.clear()})
        if request.method == "GET":
            return _json({"pending": self.faults.pending()})
        try:
            fault = parse_fault(_loads(await request.body()))
        except ValueError as exc:
            return _error(400, str(exc))
        self.faults.push(fault)
        return _json({"queued": fault.to_dict(), "pending": self.faults.pending()})

    async def sim_requests(self, request: Request) -> Response:
        if request.method == "DELETE":
            cleared = len(self.requests)
            self.requests.clear()
            return _json({"cleared": cleared})
        return _json(list(self.requests))

    async def sim_stats(self, request: Request) -> Response:
        stats = {
            **asdict(self.stats),
            "running": self._running_count(),
            "cached_sequences": len(self.engine.cache),
            "paused": self.pause_mode,
            "held": sum(run.gen is not None for run in self._waiting),
            "waiting": sum(run.gen is None for run in self._waiting),
        }
        return _json(stats)

    async def sim_reset(self, request: Request) -> Response:
        """Back to a fresh server (faults, scripts, request log, stats, prefix cache), without a restart."""
        self.faults.clear()
        self.scripts.clear()
        self.requests.clear()
        self.stats = Stats()
        self.engine.cache.clear()
        self.engine.weight_version = self.config.weight_version
        self.engine.pending_update = None
        self.engine.continuations.clear()
        self.pause_mode = None
        for run in list(self._waiting):
            run.release()
        return _json({"reset": True})

    async def sim_weight_version(self, request: Request) -> Response:
        """Simulate a weight update: `{"weight_version": V}` now (later answers carry V), or with `"after_tokens": K`
        inside the next answer, after its K-th generated token (its `weight_versions` then has two spans)."""
        try:
            update = parse_weight_update(_loads(await request.body()))
        except BadRequest as exc:
            return _error(400, str(exc))
        self.engine.update_weights(update)
        answer: dict[str, Any] = {"weight_version": update.version}
        if update.after_tokens is not None:
            answer["after_tokens"] = update.after_tokens
        return _json(answer)

    async def sim_script(self, request: Request) -> Response:
        """Queue scripted answers for a rid prefix (POST), list them (GET) or drop them all (DELETE)."""
        if request.method == "DELETE":
            return _json({"cleared": self.scripts.clear()})
        if request.method == "GET":
            return _json({"pending": self.scripts.pending()})
        try:
            prefix, answers = parse_script(_loads(await request.body()), self.engine.vocab)
        except BadRequest as exc:
            return _error(400, str(exc))
        self.scripts.add(prefix, answers)
        return _json({"queued": len(answers), "pending": self.scripts.pending()})


def create_app(config: SimulatorConfig | None = None) -> Starlette:
    """The ASGI app of one simulated worker; `app.state.simulator` exposes its state to in-process tests."""
    simulator = Simulator(config or SimulatorConfig())
    app = Starlette(routes=simulator.routes())
    app.state.simulator = simulator
    return app
