"""Row 16: the session inspector renders a 32k-token MoE session (48 layers, top-8) in a real browser.

One session on the shared gateway (the simulator's 48-layer top-8 MoE): a prompt, then model turns with tool tokens
appended between them, routing and top-p replay, ``tokens`` in all. Debian's chromium (headless, driven by Playwright
as in tests/test_ui.py) opens ``/ui/sessions/{id}`` in a fresh page, ``loads`` times: the render time is the page's
own ``inspectorTimings.ready_ms``, from the navigation's start to the end of the first full draw (the HTML and
scripts, the JSON view and the safetensors data fetched, parsed, every panel drawn). Then, zoomed to 4 px a token,
the scroll bar is moved ``scroll_steps`` times, one step per animation frame: the time each redraw takes (the page's
``inspectorTimings.frames``), against a 60 Hz frame.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import httpx

from bench.core import Check, Context, RowResult, log, percentile
from bench.services import CHROMIUM_ARGS, find_chromium
from bench.workload import TOP_P_FLAG, prompt_ids

NAME = "inspector render, 32k tokens"
GOAL_RENDER_MS = 2000.0
GOAL_FRAME_MS = 1000.0 / 60
HTTP_TIMEOUT = httpx.Timeout(600.0, connect=5.0)


@dataclass(frozen=True, slots=True)
class Shape:
    prompt_tokens: int
    turns: int
    turn_tokens: int
    tool_tokens: int
    loads: int
    scroll_steps: int

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.turns * (self.turn_tokens + self.tool_tokens)


SHAPES = {
    "full": Shape(prompt_tokens=4_000, turns=7, turn_tokens=3_900, tool_tokens=100, loads=5, scroll_steps=120),
    "quick": Shape(prompt_tokens=512, turns=2, turn_tokens=480, tool_tokens=32, loads=1, scroll_steps=10),
}


def chromium() -> str:
    found = find_chromium()
    if found is None:
        raise RuntimeError("row 16 needs Debian's chromium: `make chromium` (scripts/chromium.sh)")
    return found


def build_session(gateway_url: str, shape: Shape, ctx: Context) -> str:
    """The session: prompt, then (model turn, tool tokens) x turns, through the gateway's API."""
    moe = ctx.suite.moe
    sid = f"bench-ui-{ctx.suite.name}"
    with httpx.Client(base_url=gateway_url, timeout=HTTP_TIMEOUT) as http:
        http.delete(f"/v1/sessions/{sid}")
        body = {
            "session_id": sid,
            "prompt_ids": prompt_ids(shape.prompt_tokens, seed=16),
            "num_layers": moe.layers,
            "moe_router_topk": moe.topk,
            "metadata": {"bench": "row 16"},
        }
        http.post("/v1/sessions", json=body).raise_for_status()
        sampling = {"max_new_tokens": shape.turn_tokens, "ignore_eos": True, "temperature": 1.0, **TOP_P_FLAG}
        for turn in range(shape.turns):
            http.post(f"/v1/sessions/{sid}/generate", json={"sampling_params": sampling}).raise_for_status()
            tool = prompt_ids(shape.tool_tokens, seed=160 + turn)
            http.post(f"/v1/sessions/{sid}/append", json={"token_ids": tool}).raise_for_status()
        total = http.get(f"/v1/sessions/{sid}").json()["total_tokens"]
    assert total == shape.tokens, (total, shape.tokens)
    return sid


SCROLL = """async (steps) => {
    const bar = document.getElementById("hscroll");
    const frames = window.inspectorTimings.frames;
    const before = frames.length;
    const nextFrame = () => new Promise((resolve) => requestAnimationFrame(() => resolve()));
    for (let i = 0; i < steps; i++) {
        bar.scrollLeft += 397;
        await nextFrame();
        await nextFrame();
    }
    return frames.slice(before);
}"""


def measure(url: str, shape: Shape) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    loads: list[dict[str, Any]] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS, headless=True)
        try:
            context = browser.new_context(viewport={"width": 1600, "height": 1000})
            for _ in range(shape.loads):
                page = context.new_page()
                page.goto(url)
                page.wait_for_selector("body[data-ready='1']", timeout=60_000)
                loads.append(page.evaluate("window.inspectorTimings"))
                page.close()
            page = context.new_page()
            page.goto(url)
            page.wait_for_selector("body[data-ready='1']", timeout=60_000)
            page.select_option("#zoom", "4")
            frames = page.evaluate(SCROLL, shape.scroll_steps)
            page.select_option("#zoom", "fit")
            page.wait_for_timeout(100)
            fit = page.evaluate("window.inspectorTimings.frames.slice(-1)[0]")
            nodes = page.evaluate("document.querySelectorAll('*').length")
        finally:
            browser.close()
    return {"loads": loads, "frames": frames, "fit_frame": fit, "nodes": nodes}


def run(ctx: Context) -> RowResult:
    shape = SHAPES[ctx.suite.name]
    moe = ctx.suite.moe
    gateway = ctx.services.gateway
    log(f"row 16: building a {shape.tokens}-token session ({moe.describe()})")
    sid = build_session(gateway.url, shape, ctx)
    got = measure(f"{gateway.url}/ui/sessions/{sid}", shape)
    httpx.delete(f"{gateway.url}/v1/sessions/{sid}")
    ready = [load["ready_ms"] for load in got["loads"]]
    render = statistics.median(ready)
    last = got["loads"][-1]
    frames = got["frames"]
    frame_p95 = percentile(frames, 95)
    cells = (shape.tokens - 1) * moe.layers * moe.topk
    return RowResult(
        number=16,
        name=NAME,
        measured=(
            f"{shape.tokens} tokens, {cells / 1e6:.1f}M routing cells: ready in {render:.0f} ms (median of "
            f"{len(ready)}; {last['bytes'] / 2**20:.1f} MiB fetched, draw {last['draw_ms']:.0f} ms); scroll redraw "
            f"median {statistics.median(frames):.1f} ms, p95 {frame_p95:.1f} ms, max {max(frames):.1f} ms; "
            f"whole-session view {got['fit_frame']:.1f} ms"
        ),
        checks=[
            Check("render", render, GOAL_RENDER_MS, False, "ms"),
            Check("scroll frame p95", frame_p95, GOAL_FRAME_MS, False, "ms"),
        ],
        notes=[
            f"one session on the shared gateway: a {shape.prompt_tokens}-token prompt, then {shape.turns} x "
            f"({shape.turn_tokens} generated tokens + {shape.tool_tokens} appended tool tokens), {moe.describe()}, "
            "routing and top-p replay, made through the session API (not timed)",
            "Debian's chromium, headless (Playwright, executable_path), a 1600x1000 viewport; render: the page's "
            "inspectorTimings.ready_ms (performance.now() at the end of the first full draw: from the navigation's "
            f"start, so the HTML, scripts, JSON view and data fetch are in it), median of {len(ready)} fresh pages; "
            f"all loads: {', '.join(f'{r:.0f}' for r in ready)} ms; the last one's parts: fetch "
            f"{last['fetch_ms']:.0f} ms, parse {last['parse_ms']:.0f} ms, derive {last['derive_ms']:.0f} ms (roles, "
            f"turns, expert load), draw {last['draw_ms']:.0f} ms",
            f"scroll: at 4 px a token, the scroll bar moved {shape.scroll_steps} times by 397 px, one step every two "
            "animation frames; each redraw's time is the page's own measure (inspectorTimings.frames: the tracks "
            f"canvas and its overlay); the whole-session view redraws in {got['fit_frame']:.1f} ms; "
            f"{got['nodes']} DOM nodes in the page",
        ],
    )
