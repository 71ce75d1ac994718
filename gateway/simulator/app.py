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


class _Running:
    """A prompt being generated: what /abort_request and a disconnect signal."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.event = asyncio.Event()
        self.disconnected = False

    def abort(self) -> None:
        self.event.set()

    def disconnect(self) -> None:
        self.disconnected = True
        self.event.set()

    async def sleep(self, seconds: float) -> bool:
        """Sleep like a model generating; False as soon as the request is aborted or its client is gone."""
        if self.event.is_set():
            return False
        if seconds <= 0:
            return True
        try:
            await asyncio.wait_for(self.event.wait(), seconds)
        except TimeoutError:
            return True
        return False


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
        runs = [_Running(item.rid) for item in items]
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
        gen = self._start(item, fault)
        self._register(run)
        try:
            m, aborted = await self._pace(gen.n, run)
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

    async def _pace(self, n: int, run: _Running) -> tuple[int, bool]:
        """Wait as long as generating `n` tokens takes; on abort, how many tokens were done by then."""
        latency = self.config.latency_ms / 1000
        per_token = self.config.token_delay_ms / 1000
        t0 = time.perf_counter()
        if await run.sleep(latency + n * per_token):
            return n, False
        done = int((time.perf_counter() - t0 - latency) / per_token) if per_token > 0 else 0
        return min(max(done, 0), max(n - 1, 0)), True

    # ------------------------------------------------------------------------------------- streaming

    def _stream(self, item: GenItem, fault: Fault | None, started: float) -> Response:
        gen = self._start(item, fault)
        run = _Running(item.rid)
        return _EventStream(self._events(gen, run, fault.mode if fault else None, started), run)

    async def _events(
        self, gen: Generation, run: _Running, mode: str | None, started: float
    ) -> AsyncGenerator[Event | None, None]:
        """Cumulative chunks paced like token generation, then the final chunk and [DONE]."""
        cfg = self.config
        per_token = cfg.token_delay_ms / 1000
        stop_at = gen.n // 2 if mode == "abort" else gen.n
        m, sent, aborted = 0, 0, False
        self._register(run)
        try:
            aborted = not await run.sleep(cfg.latency_ms / 1000)
            while not aborted and m < stop_at:
                target = min(m + cfg.stream_chunk_tokens, stop_at)
                if not await run.sleep((target - m) * per_token):
                    aborted = True
                    break
                if mode in ("cut_stream", "stream_error") and (sent >= CUT_AFTER_CHUNKS or target == stop_at):
                    for event in self._broken_ending(mode):
                        yield event
                    return
                m = target
                if m == stop_at:
                    break  # the last tokens travel with the final chunk
                yield self._maybe_malformed(_sse(gen.chunk(m, first=sent == 0)), mode, sent)
                sent += 1
                if per_token == 0:
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

    def _start(self, item: GenItem, fault: Fault | None) -> Generation:
        script = self.scripts.take(item.rid)
        gen = self.engine.start(item, script)
        if fault is not None:
            gen.distortion = fault.distortion
        self.stats.items += 1
        self.stats.scripted += script is not None
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
        self.engine.cache.clear()
        return Response("Cache flushed.\n", media_type="text/plain")

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
        stats = {**asdict(self.stats), "running": self._running_count(), "cached_sequences": len(self.engine.cache)}
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
