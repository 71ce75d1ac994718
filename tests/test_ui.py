"""The session inspector (``/ui/``): its data routes and cookie over HTTP, and its pages in a real browser.

The browser is Debian's chromium (``make chromium``: scripts/chromium.sh), driven headless by Playwright through
``executable_path`` (no browser download) with the flags this kind of machine needs, a fresh profile per launch.
Without chromium or Playwright the browser tests skip and say why; the HTTP tests still run.

The demo session is an agent's: the OpenAI client in a tool loop on a chat gateway (a tiny real tokenizer, scripted
answers), with routing and top-p replay, then an edited tool result that forks a branch. What is checked against the
JSON view and the sample: the counts the page shows (tokens, trainable tokens, turns, branches), a hovered token's
id, text and log-prob, switching branch; logging in with a key (the cookie: HttpOnly, SameSite=Strict, not the key,
never a URL; it opens reads only); model and tool text that holds markup shown as text. Screenshots go to each test's
tmp dir; ``UPDATE_INSPECTOR_SCREENSHOT=1`` also writes docs/inspector.png (the README's and the docs' screenshot).
Render times are printed here and measured in the bench (row 16), never asserted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
import zipfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from chat_checks import CALL_TEXT, FINAL_TEXT, WEATHER_TOOL, openai_client, sample, script, view
from chat_checks import new_session as new_chat_session
from conftest import SIM_LAYERS, SIM_TOPK, Service, run_gateway
from procs import REPO_ROOT
from safetensors.numpy import load

from bench.services import CHROMIUM_ARGS, CHROMIUM_DIR, find_chromium
from gateway.auth import UI_COOKIE, KeyRing, cookie_token
from slime_client.sample import read_safetensors_metadata

VIEWPORT = {"width": 1400, "height": 1000}
DOCS_SCREENSHOT = REPO_ROOT / "docs" / "inspector.png"
READY = "body[data-ready='1']"

TOOLS = [WEATHER_TOOL]
SCRIPT_TAG = "<script>window.__xss = 1</script>"
IMG_TAG = '"><img src=x onerror="window.__xss = 2">'


# ---- helpers: sessions ------------------------------------------------------------------------------------------
def new_session(gateway: Service, headers: dict[str, str] | None = None, **body: Any) -> str:
    sid = body.pop("session_id", None) or f"ui-{uuid.uuid4().hex[:10]}"
    response = httpx.post(f"{gateway.url}/v1/sessions", json={"session_id": sid, **body}, headers=headers)
    assert response.status_code == 201, response.text
    return sid


def chat_session(gateway: Service, **extra: Any) -> str:
    """A chat session with routing and top-p replay (chat_checks.new_session), named ``ui-...``."""
    return new_chat_session(gateway, prefix="ui", **extra)


def chat(gateway: Service, sid: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    client = openai_client(gateway, sid)
    completion = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=256)
    return completion.choices[0].message.model_dump(exclude_none=True)


def compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def agent_session(gateway: Service, sim: Service) -> str:
    """Two model turns with a tool call and its result between them, then the tool result edited: a fork."""
    sid = chat_session(gateway, metadata={"task": "weather", "group": 3})
    script(sim, sid, CALL_TEXT, FINAL_TEXT)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    reply = chat(gateway, sid, messages)
    messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "sunny"}]
    messages.append(chat(gateway, sid, messages))
    script(sim, sid, "Take an umbrella.")
    edited = [*messages[:2], {**messages[2], "content": "raining"}]
    assert chat(gateway, sid, edited)["content"] == "Take an umbrella."
    return sid


# ---- helpers: the browser -----------------------------------------------------------------------------------------
def chromium_executable() -> str:
    """Debian's chromium, as scripts/chromium.sh found or installed it; a skip naming why when there is none."""
    found = find_chromium()
    if found is not None:
        return found
    log = CHROMIUM_DIR / "install.log"
    why = log.read_text().strip()[-500:] if log.exists() else "run `make chromium` (scripts/chromium.sh)"
    pytest.skip(f"no chromium: {why}")


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Any]:
    try:
        from playwright.async_api import async_playwright
    except ImportError as exc:
        pytest.skip(f"playwright is not installed (the dev extra, `make install`): {exc}")
    executable = chromium_executable()
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS, headless=True)
        try:
            yield launched
        finally:
            await launched.close()


class PageWatch:
    """What a page reported besides its content: script errors, console errors (a CSP violation is one), dialogs."""

    def __init__(self, page: Any) -> None:
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))
        page.on("console", lambda msg: self.errors.append(f"console: {msg.text}") if msg.type == "error" else None)

        async def dismiss(dialog: Any) -> None:
            self.dialogs.append(dialog.message)
            await dialog.dismiss()

        page.on("dialog", dismiss)


@pytest.fixture
async def context(browser: Any) -> AsyncIterator[Any]:
    """A fresh browser context (its own cookies) per test."""
    ctx = await browser.new_context(viewport=VIEWPORT)
    try:
        yield ctx
    finally:
        await ctx.close()


async def open_page(context: Any, url: str) -> tuple[Any, PageWatch]:
    page = await context.new_page()
    watch = PageWatch(page)
    await page.goto(url)
    await page.wait_for_selector(READY, timeout=20_000)
    return page, watch


async def text(page: Any, selector: str) -> str:
    return (await page.locator(selector).text_content() or "").strip()


async def count(page: Any, selector: str) -> int:
    return int((await text(page, selector)).replace(",", ""))


async def hover_token(page: Any, index: int) -> None:
    """Bring token ``index`` into view with the scroll bar, then move the mouse onto it in the token row. Each
    attempt scrolls again: a zoom change just before may still be growing the scroll bar's range (a scroll set
    meanwhile stops short), or a late scroll event may move the strip under the mouse."""
    from playwright.async_api import TimeoutError as PlaywrightTimeout

    for attempt in range(5):
        await page.evaluate(
            """(i) => {
                const canvas = document.getElementById("tracks-canvas");
                document.getElementById("hscroll").scrollLeft = Math.max(0, i * +canvas.dataset.cellWidth - 300);
            }""",
            index,
        )
        await page.wait_for_function(
            """() => Math.abs(+document.getElementById("tracks-canvas").dataset.scroll
                     - document.getElementById("hscroll").scrollLeft) < 1"""
        )
        await page.mouse.move(0, 0)  # off the strip: the next move is a change whatever was hovered before
        # Where the token is now, read after two frames (a redraw queued by a late scroll event has run).
        spot = await page.evaluate(
            """(i) => new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(() => {
                const canvas = document.getElementById("tracks-canvas"), data = canvas.dataset;
                const box = canvas.getBoundingClientRect(), cell = +data.cellWidth;
                done([box.left + +data.gutter + i * cell - +data.scroll + cell / 2, box.top + +data.tokenY]);
            })))""",
            index,
        )
        await page.mouse.move(spot[0], spot[1] + attempt)
        try:
            await page.wait_for_function(
                "(i) => document.getElementById('detail-position').textContent.replace(/,/g, '').startsWith(i + ' of')",
                arg=index,
                timeout=3_000,
            )
            return
        except PlaywrightTimeout:
            continue
    raise AssertionError(f"hovering token {index} did not show it: {await text(page, '#detail-position')}")


# ---- the pages and files: served from the package, with a CSP ------------------------------------------------------
def test_pages_are_static_files_with_a_content_security_policy(gateway: Service) -> None:
    for path in ("/ui/", "/ui/sessions/any-id", "/ui/static/session.js", "/ui/static/inspector.css"):
        response = httpx.get(gateway.url + path)
        assert response.status_code == 200, (path, response.text)
        csp = response.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert response.headers["x-content-type-options"] == "nosniff"
    page = httpx.get(f"{gateway.url}/ui/sessions/any-id").text
    assert "<script>" not in page and page.count("<script src=") == 2  # no inline script anywhere
    assert "http://" not in page and "https://" not in page  # nothing from elsewhere
    assert httpx.get(f"{gateway.url}/ui").headers["location"] == "/ui/"
    assert httpx.get(f"{gateway.url}/ui", follow_redirects=True).status_code == 200
    for bad in ("/ui/static/nope.js", "/ui/static/..%2F__init__.py", "/ui/static/%2E%2E/__init__.py"):
        assert httpx.get(gateway.url + bad).status_code == 404, bad


def test_a_gateway_without_keys_needs_no_login(gateway: Service) -> None:
    login = httpx.post(f"{gateway.url}/ui/login", headers={"authorization": "Bearer anything"})
    assert login.status_code == 200 and login.json()["required"] is False and "set-cookie" not in login.headers


def test_the_json_view_links_to_the_session_page(gateway: Service) -> None:
    sid = new_session(gateway, prompt_ids=[1, 2, 3])
    assert view(gateway, sid)["inspector"] == f"/ui/sessions/{sid}"


def test_the_static_files_ship_in_the_wheel(tmp_path: Path) -> None:
    """The image installs the wheel: the pages must be in it (pyproject's package-data), not only in this checkout."""
    if shutil.which("git") is None:
        pytest.skip("git is needed to copy the tracked files")
    source = tmp_path / "src"
    source.mkdir()
    tracked = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO_ROOT, capture_output=True)
    for name in tracked.stdout.decode().splitlines():
        if (REPO_ROOT / name).is_file() and name.startswith(("gateway/", "slime_client/", "slime_wire/")):
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / name, source / name)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO_ROOT / name, source / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("slime_gateway-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {p.name for p in (REPO_ROOT / "gateway" / "ui" / "static").iterdir()}
    assert {f"gateway/ui/static/{name}" for name in shipped} <= names
    assert "gateway/routes/ui.py" in names


# ---- the list's data: a page of rows, filters ------------------------------------------------------------------
def test_the_session_list_pages_newest_first_and_filters(gateway: Service) -> None:
    suite = uuid.uuid4().hex[:8]
    created = [new_session(gateway, prompt_ids=[1, 2, 3, 4], metadata={"suite": suite, "i": i}) for i in range(5)]
    generate = {"sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    assert httpx.post(f"{gateway.url}/v1/sessions/{created[1]}/generate", json=generate).status_code == 200

    def page(**params: Any) -> dict[str, Any]:
        response = httpx.get(f"{gateway.url}/ui/api/sessions", params=params)
        assert response.status_code == 200, response.text
        return response.json()

    mine = page(meta=f"suite={suite}", limit=10)
    assert mine["total"] == 5
    assert [row["session_id"] for row in mine["sessions"]] == created[::-1]  # newest first
    row = mine["sessions"][3]
    assert row["session_id"] == created[1] and row["status"] == "truncated" and row["turns"] == 1
    assert row["total_tokens"] == 7 and row["branches"] == 1 and row["last_error"] is None
    assert json.loads(row["metadata"]) == {"suite": suite, "i": 1}
    second = page(meta=f"suite={suite}", limit=2, offset=2)
    assert [r["session_id"] for r in second["sessions"]] == created[2::-1][:2] and second["total"] == 5
    assert [r["session_id"] for r in page(meta=[f"suite={suite}", "i=3"])["sessions"]] == [created[3]]
    truncated = page(meta=f"suite={suite}", status="truncated")
    assert [r["session_id"] for r in truncated["sessions"]] == [created[1]]
    assert page(meta=f"suite={suite}", status="aborted")["total"] == 0
    everything = page(limit=1)
    assert everything["total"] >= 5 and everything["sessions"][0]["session_id"] == created[-1]
    for bad in ({"limit": 0}, {"limit": 501}, {"offset": -1}, {"status": "bogus"}, {"meta": "no-equals"}):
        response = httpx.get(f"{gateway.url}/ui/api/sessions", params=bad)
        assert response.status_code == 422, (bad, response.text)
        assert response.json()["error"]["type"] == "invalid_request"


def test_the_session_list_on_the_redis_store(redis_gateway: Service) -> None:
    """A store whose sessions live elsewhere is paged from its list: newest first, status filters, pages."""
    created = [new_session(redis_gateway, prompt_ids=[1, 2, 3]) for _ in range(3)]
    generate = {"sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    assert httpx.post(f"{redis_gateway.url}/v1/sessions/{created[0]}/generate", json=generate).status_code == 200
    first = httpx.get(f"{redis_gateway.url}/ui/api/sessions", params={"limit": 3}).json()
    assert [row["session_id"] for row in first["sessions"]] == created[::-1] and first["total"] >= 3
    assert all(row["branches"] == 1 for row in first["sessions"])
    rows = httpx.get(f"{redis_gateway.url}/ui/api/sessions", params={"status": "truncated", "limit": 500}).json()
    assert created[0] in [row["session_id"] for row in rows["sessions"]]
    assert all(row["status"] == "truncated" for row in rows["sessions"])
    second = httpx.get(f"{redis_gateway.url}/ui/api/sessions", params={"limit": 1, "offset": 1}).json()
    assert [row["session_id"] for row in second["sessions"]] == [created[1]]


def test_an_aborted_turn_is_the_sessions_last_error(gateway: Service, simulator: Service) -> None:
    suite = uuid.uuid4().hex[:8]
    sid = new_session(gateway, prompt_ids=[1, 2, 3], metadata={"suite": suite})
    assert httpx.post(f"{simulator.url}/sim/faults", json={"mode": "abort"}).status_code == 200
    generate = {"sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}
    assert httpx.post(f"{gateway.url}/v1/sessions/{sid}/generate", json=generate).status_code == 200
    finish = view(gateway, sid)["turn_log"][-1]["finish_reason"]
    assert finish["type"] == "abort"
    (row,) = httpx.get(f"{gateway.url}/ui/api/sessions", params={"meta": f"suite={suite}"}).json()["sessions"]
    assert row["session_id"] == sid and row["status"] == "aborted"
    assert row["last_error"] == (finish.get("message") or "abort")
    assert view(gateway, sid)["last_error"] == row["last_error"]  # the summary carries it too


def test_the_data_route_is_the_sample_plus_turns_and_pieces(chat_gateway: Service, chat_sim: Service) -> None:
    sid = agent_session(chat_gateway, chat_sim)
    state = view(chat_gateway, sid)
    for branch in (None, 0):
        params = {} if branch is None else {"branch": branch}
        response = httpx.get(f"{chat_gateway.url}/ui/api/sessions/{sid}/data", params=params)
        assert response.status_code == 200 and response.headers["content-type"] == "application/vnd.safetensors"
        arrays = load(response.content)
        expected = sample(chat_gateway, sid, branch)
        assert arrays.keys() == expected.keys()
        for name, values in expected.items():
            np.testing.assert_array_equal(arrays[name], values)
        meta = read_safetensors_metadata(response.content)
        turns = json.loads(meta["turn_log"])
        assert sum(t["num_tokens"] for t in turns) == len(arrays["tokens"]) - int(meta["prompt_length"])
        if branch is None:
            assert turns == state["turn_log"]
        pieces = json.loads(meta["pieces"])
        assert set(pieces) == {str(i) for i in np.unique(arrays["tokens"])}
    assert httpx.get(f"{chat_gateway.url}/ui/api/sessions/{sid}/data", params={"branch": 7}).status_code == 404
    assert httpx.get(f"{chat_gateway.url}/ui/api/sessions/nope/data").status_code == 404


# ---- the cookie ---------------------------------------------------------------------------------------------------
KEYS = ("ui-key-one", "ui-key-two")


@pytest.fixture(scope="module")
def keyed_gateway(simulator: Service) -> Iterator[Service]:
    with run_gateway(simulator.url, "--log-level", "warning", env={"GATEWAY_API_KEY": ",".join(KEYS)}) as service:
        yield service


def test_the_cookie_opens_the_inspectors_reads_only(keyed_gateway: Service) -> None:
    url = keyed_gateway.url
    bearer = {"authorization": f"Bearer {KEYS[1]}"}
    sid = new_session(keyed_gateway, headers=bearer, prompt_ids=[1, 2, 3])
    for path in ("/ui/", f"/ui/sessions/{sid}", "/ui/static/common.js"):  # static shells: no data in them
        assert httpx.get(url + path).status_code == 200, path
    assert httpx.get(f"{url}/ui/api/sessions").status_code == 401

    assert httpx.post(f"{url}/ui/login").status_code == 401
    assert httpx.post(f"{url}/ui/login", headers={"authorization": "Bearer wrong"}).status_code == 401
    login = httpx.post(f"{url}/ui/login", headers=bearer)
    assert login.status_code == 200
    set_cookie = login.headers["set-cookie"]
    assert set_cookie.startswith(f"{UI_COOKIE}={cookie_token(KEYS[1].encode())};")
    attributes = {part.strip().lower() for part in set_cookie.split(";")[1:]}
    assert {"httponly", "samesite=strict", "path=/"} <= attributes
    assert KEYS[1] not in set_cookie

    cookie = {"cookie": f"{UI_COOKIE}={cookie_token(KEYS[1].encode())}"}
    for path in (
        "/ui/api/sessions",
        f"/ui/api/sessions/{sid}/data",
        f"/v1/sessions/{sid}",
        f"/v1/sessions/{sid}/sample",
    ):
        assert httpx.get(url + path, headers=cookie).status_code == 200, path
    assert httpx.get(f"{url}/v1/sessions", headers=cookie).status_code == 200
    # Nothing that changes a session, and nothing outside the inspector's routes.
    assert httpx.post(f"{url}/v1/sessions", json={"prompt_ids": [1]}, headers=cookie).status_code == 401
    assert httpx.post(f"{url}/v1/sessions/{sid}/append", json={"token_ids": [1]}, headers=cookie).status_code == 401
    assert httpx.delete(f"{url}/v1/sessions/{sid}", headers=cookie).status_code == 401
    assert httpx.get(f"{url}/get_server_info", headers=cookie).status_code == 401
    assert httpx.post(f"{url}/ui/login", headers=cookie).status_code == 401  # a cookie does not mint cookies
    assert view(keyed_gateway, sid, headers=bearer)["total_tokens"] == 3  # unchanged

    forged = httpx.get(f"{url}/ui/api/sessions", headers={"cookie": f"{UI_COOKIE}={KEYS[1]}"})  # the key itself
    assert forged.status_code == 401 and forged.json()["error"]["reason"] == "invalid_key"
    # A wrong header is not rescued by a good cookie.
    both = httpx.get(f"{url}/ui/api/sessions", headers={**cookie, "authorization": "Bearer wrong"})
    assert both.status_code == 401
    logout = httpx.post(f"{url}/ui/logout", headers=cookie)
    assert logout.status_code == 200 and "max-age=0" in logout.headers["set-cookie"].lower()


def test_a_cookie_belongs_to_one_key() -> None:
    ring = KeyRing(["k1"])
    assert ring.matches_cookie(cookie_token(b"k1").encode())
    assert not ring.matches_cookie(cookie_token(b"k2").encode())  # a key rotated out ends its cookies
    assert not ring.matches_cookie(b"k1") and not ring.matches(cookie_token(b"k1").encode())


# ---- in the browser -----------------------------------------------------------------------------------------------
async def test_the_list_shows_the_newest_sessions_and_filters(
    context: Any, chat_gateway: Service, chat_sim: Service, tmp_path: Path
) -> None:
    sid = agent_session(chat_gateway, chat_sim)
    marker = uuid.uuid4().hex[:8]
    tagged = new_session(chat_gateway, prompt_ids=[1, 2, 3], metadata={"marker": marker, "note": IMG_TAG})
    page, watch = await open_page(context, f"{chat_gateway.url}/ui/")
    first_rows = await page.locator("#rows tr").evaluate_all("rows => rows.map(r => r.dataset.session)")
    assert first_rows[:2] == [tagged, sid]
    row = page.locator(f"#rows tr[data-session='{sid}']")
    cells = [c.strip() for c in await row.locator("td").all_text_contents()]
    state = view(chat_gateway, sid)
    assert cells[:5] == [sid, state["status"], "2", str(state["total_tokens"]), str(state["turns"])]
    assert '"task":"weather"' in cells[8]
    await page.screenshot(path=str(tmp_path / "list.png"), full_page=True)

    await page.fill("#filter-meta", f"marker={marker}")
    await page.click("#filters button[type=submit]")
    await page.wait_for_function("() => document.querySelectorAll('#rows tr').length === 1")
    assert await page.locator("#rows tr").get_attribute("data-session") == tagged
    assert f"meta=marker%3D{marker}" in page.url
    shown = await text(page, f"#rows tr[data-session='{tagged}'] td.meta")  # as text
    assert shown == compact_json({"marker": marker, "note": IMG_TAG})
    assert await page.locator("#rows img").count() == 0

    await page.select_option("#filter-status", "aborted")
    await page.fill("#filter-meta", "")
    await page.click("#filters button[type=submit]")
    await page.wait_for_function("() => location.search === '?status=aborted'")
    await page.wait_for_selector(READY)
    statuses = await page.locator("#rows .status").all_text_contents()
    assert all(s.startswith("aborted") for s in statuses)

    await page.goto(f"{chat_gateway.url}/ui/")
    await page.click(f"#rows a[href='/ui/sessions/{sid}']")
    await page.wait_for_selector(READY)
    assert await text(page, "#session-id") == sid
    assert watch.errors == [] and watch.dialogs == []


async def test_a_demo_session_shows_what_the_json_view_says(
    context: Any, chat_gateway: Service, chat_sim: Service, tokenizer: Any, tmp_path: Path
) -> None:
    sid = agent_session(chat_gateway, chat_sim)
    state = view(chat_gateway, sid)
    live = sample(chat_gateway, sid)
    page, watch = await open_page(context, f"{chat_gateway.url}/ui/sessions/{sid}")
    timings = await page.evaluate("window.inspectorTimings")
    print(f"demo session ({state['total_tokens']} tokens): ready in {timings['ready_ms']:.0f} ms, {timings}")

    assert await count(page, "#count-tokens") == state["total_tokens"] == len(live["tokens"])
    assert await count(page, "#count-prompt") == state["prompt_length"]
    assert await count(page, "#count-trainable") == int(live["loss_mask"].sum())
    assert await count(page, "#count-turns") == state["turns"]
    assert await count(page, "#count-branches") == len(state["branches"]) == 2
    assert (await text(page, "#count-branch")).startswith(str(state["branch"])) and state["branch"] == 0
    assert await text(page, "#count-routing") == (
        f"{state['replay']['routed_experts_rows']} rows · {SIM_LAYERS} layers × top-{SIM_TOPK} · "
        f"{int(live['rollout_routed_experts'].max()) + 1} experts seen"
    )
    assert [m["content"][:20] for m in state["chat"]["messages"]] == [
        t[:20] for t in await page.locator("#chat .content").all_text_contents()
    ]
    lowest = int(np.argmin(np.where(live["loss_mask"] == 1, live["rollout_log_probs"], np.inf)))
    assert (await text(page, "#lowest")).endswith(f"at {state['prompt_length'] + lowest:,}")

    # Hover a trainable token: its id, text and log-prob as the sample has them.
    prompt = state["prompt_length"]
    position = prompt + int(np.flatnonzero(live["loss_mask"] == 1)[2])
    await hover_token(page, position)
    token_id = int(live["tokens"][position])
    assert await text(page, "#detail-id") == str(token_id)
    assert await text(page, "#detail-logprob") == f"{live['rollout_log_probs'][position - prompt]:.6f}"
    assert await text(page, "#detail-piece") == json.dumps(tokenizer.decode([token_id]), ensure_ascii=False)
    assert await text(page, "#detail-role") == "model (trainable)"
    offsets = live["rollout_top_p_token_offsets"]
    kept = offsets[position - prompt + 1] - offsets[position - prompt]
    assert (await text(page, "#detail-topp")).startswith(f"{kept} ids")
    assert await text(page, "#detail-version") == state["weight_version_table"][0]
    routing_lines = (await text(page, "#detail-routing")).splitlines()
    experts = live["rollout_routed_experts"][position]
    assert [line.split(":")[1].split() for line in routing_lines] == [[str(e) for e in row] for row in experts]
    await page.mouse.click(*(await _mouse(page)))  # pin it
    await page.screenshot(path=str(tmp_path / "session.png"), full_page=True)
    if os.environ.get("UPDATE_INSPECTOR_SCREENSHOT"):
        await page.screenshot(path=str(DOCS_SCREENSHOT), full_page=True)
    # A tool token is not trainable, and says so.
    tool = prompt + int(np.flatnonzero(live["loss_mask"] == 0)[0])
    await hover_token(page, tool)
    assert await text(page, "#detail-role") == "tool / appended (not trainable)"
    assert (await text(page, "#detail-logprob")).endswith("(not trainable)")

    # Switch to the forked branch: the counts follow it; then back to the root.
    await page.click("#branch-tree button[data-branch='1']")
    await page.wait_for_selector("body[data-branch='1'][data-ready='1']")
    fork = sample(chat_gateway, sid, branch=1)
    assert "branch=1" in page.url
    assert await count(page, "#count-tokens") == len(fork["tokens"]) == state["branches"][1]["total_tokens"]
    assert await count(page, "#count-trainable") == int(fork["loss_mask"].sum())
    assert await count(page, "#count-turns") == state["branches"][1]["turns"]
    assert await text(page, "#count-branch") == "1 (from b0)"
    fork_chat = view(chat_gateway, sid, branch=1)["chat"]["messages"]  # that branch's own record, not the root's
    contents = await page.locator("#chat .content").all_text_contents()
    assert [m["content"][:20] for m in fork_chat] == [t[:20] for t in contents] and contents != [
        m["content"] for m in state["chat"]["messages"]
    ]
    assert await page.locator("#branch-tree button[aria-current='true']").get_attribute("data-branch") == "1"
    await page.screenshot(path=str(tmp_path / "branch-1.png"), full_page=True)
    await page.click("#branch-tree button[data-branch='0']")
    await page.wait_for_selector("body[data-branch='0'][data-ready='1']")
    assert await count(page, "#count-tokens") == state["total_tokens"]
    # The page draws cells on canvases: a few hundred DOM nodes, whatever the session's size.
    assert await page.evaluate("document.querySelectorAll('*').length") < 2000
    assert watch.errors == [] and watch.dialogs == []


async def _mouse(page: Any) -> tuple[float, float]:
    """Where the mouse is over the token the details show (the last hover_token)."""
    box = await page.locator("#tracks-canvas").bounding_box()
    data = await page.evaluate("() => ({...document.getElementById('tracks-canvas').dataset})")
    index = int((await text(page, "#detail-position")).split(" of")[0].replace(",", ""))
    cell = float(data["cellWidth"])
    x = box["x"] + float(data["gutter"]) + index * cell - float(data["scroll"]) + cell / 2
    return x, box["y"] + float(data["tokenY"])


async def test_model_and_tool_text_is_shown_as_text(
    context: Any, chat_gateway: Service, chat_sim: Service, tmp_path: Path
) -> None:
    """A model that writes markup, a tool result and metadata that hold some: all shown as the characters they are;
    no script runs, no element is made from them."""
    sid = chat_session(chat_gateway, metadata={"note": SCRIPT_TAG + IMG_TAG})
    written = f"Here: {SCRIPT_TAG} and {IMG_TAG} done."
    script(chat_sim, sid, written, "fine")
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Say {IMG_TAG}"}]
    messages.append(chat(chat_gateway, sid, messages))
    assert messages[-1]["content"] == written
    messages.append({"role": "user", "content": f"<b>bold</b> {SCRIPT_TAG}"})
    chat(chat_gateway, sid, messages)
    page, watch = await open_page(context, f"{chat_gateway.url}/ui/sessions/{sid}")
    contents = await page.locator("#chat .content").all_text_contents()
    assert contents[1] == written and SCRIPT_TAG in contents[2] and IMG_TAG in contents[0]
    assert written in await text(page, "#text")  # the first model turn's tokens, decoded
    assert await text(page, "#metadata") == compact_json({"note": SCRIPT_TAG + IMG_TAG})
    assert await page.evaluate("typeof window.__xss") == "undefined"
    assert await page.locator("img").count() == 0 and await page.locator("b").count() == 0
    assert await page.locator("script").count() == 2  # the page's own two
    await page.screenshot(path=str(tmp_path / "xss.png"), full_page=True)
    await page.goto(f"{chat_gateway.url}/ui/?meta=note={SCRIPT_TAG + IMG_TAG}")
    await page.wait_for_selector(READY)
    assert await text(page, "#rows td.meta") == compact_json({"note": SCRIPT_TAG + IMG_TAG})
    assert await page.evaluate("typeof window.__xss") == "undefined" and await page.locator("img").count() == 0
    assert watch.errors == [] and watch.dialogs == []


async def test_logging_in_with_a_key(context: Any, keyed_gateway: Service, tmp_path: Path) -> None:
    bearer = {"authorization": f"Bearer {KEYS[0]}"}
    sid = new_session(
        keyed_gateway, headers=bearer, prompt_ids=[5, 6, 7], num_layers=SIM_LAYERS, moe_router_topk=SIM_TOPK
    )
    generate = {"sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
    assert (
        httpx.post(f"{keyed_gateway.url}/v1/sessions/{sid}/generate", json=generate, headers=bearer).status_code == 200
    )

    page = await context.new_page()
    watch = PageWatch(page)
    await page.goto(f"{keyed_gateway.url}/ui/")
    await page.wait_for_selector("#login:not([hidden])")
    assert await page.locator("#sessions").is_hidden()
    await page.fill("#login-key", "not-the-key")
    await page.click("#login button[type=submit]")
    await page.wait_for_function("() => document.getElementById('login-error').textContent.length > 0")
    assert await context.cookies() == []
    await page.screenshot(path=str(tmp_path / "login.png"))

    await page.fill("#login-key", KEYS[0])
    await page.click("#login button[type=submit]")
    await page.wait_for_selector(READY)
    assert await page.locator(f"#rows tr[data-session='{sid}']").count() == 1
    (cookie,) = await context.cookies()
    assert cookie["name"] == UI_COOKIE and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert cookie["value"] == cookie_token(KEYS[0].encode()) and KEYS[0] not in cookie["value"]
    assert await page.evaluate("document.cookie") == ""  # scripts cannot read it
    assert KEYS[0] not in page.url

    await page.click(f"#rows a[href='/ui/sessions/{sid}']")
    await page.wait_for_selector(READY)
    assert await count(page, "#count-tokens") == 11
    # The cookie reads; it does not write.
    status = await page.evaluate(
        """async () => (await fetch('/v1/sessions', {method: 'POST', body: '{"prompt_ids": [1]}',
                         headers: {'content-type': 'application/json'}})).status"""
    )
    assert status == 401
    json_view = await context.request.get(f"{keyed_gateway.url}/v1/sessions/{sid}")
    assert json_view.status == 200 and (await json_view.json())["session_id"] == sid

    await page.click("#logout")
    await page.wait_for_selector("#login:not([hidden])")
    assert await context.cookies() == []
    assert not [e for e in watch.errors if "401" not in e]  # the refused fetches are logged as such, nothing else
    assert all(KEYS[0] not in e for e in watch.errors)


async def test_a_big_session_draws_on_canvases(context: Any, gateway: Service, tmp_path: Path) -> None:
    """Thousands of tokens with routing: drawn (the heatmap has colour), scrolled and zoomed without a DOM node per
    token. The render time is printed, not asserted (the bench's row 16 measures 32k tokens x 48 layers x top-8)."""
    sid = new_session(gateway, prompt_ids=list(range(3, 4003)), num_layers=SIM_LAYERS, moe_router_topk=SIM_TOPK)
    generate = {"sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    assert httpx.post(f"{gateway.url}/v1/sessions/{sid}/generate", json=generate, timeout=60).status_code == 200
    page, watch = await open_page(context, f"{gateway.url}/ui/sessions/{sid}")
    timings = await page.evaluate("window.inspectorTimings")
    print(f"6000-token session: ready in {timings['ready_ms']:.0f} ms ({timings['bytes']} bytes fetched)")
    assert await count(page, "#count-tokens") == 6000
    assert (await text(page, "#detail-piece")) == "–"
    await page.select_option("#zoom", "fit")
    await page.wait_for_function("() => +document.getElementById('tracks-canvas').dataset.cellWidth < 1")
    data = await page.evaluate("() => ({...document.getElementById('tracks-canvas').dataset})")
    heat = await page.evaluate(
        """(y) => {
            const c = document.getElementById('tracks-canvas');
            const px = c.getContext('2d').getImageData(200 * devicePixelRatio, y * devicePixelRatio, 1, 1).data;
            return Array.from(px);
        }""",
        float(data["heatY"]) + 2,
    )
    assert heat[3] == 255 and heat[:3] != [255, 255, 255]  # an expert's colour
    for level in ("1", "8", "64"):
        await page.select_option("#zoom", level)
        await page.evaluate("() => { document.getElementById('hscroll').scrollLeft += 5000; }")
    await hover_token(page, 5000)
    assert await text(page, "#detail-role") == "model (trainable)"
    assert await text(page, "#detail-piece") == "(ids only: the gateway has no --tokenizer)"
    assert await page.evaluate("document.querySelectorAll('*').length") < 3000
    await page.screenshot(path=str(tmp_path / "big.png"), full_page=True)
    assert watch.errors == [] and watch.dialogs == []


async def test_the_token_strip_shows_where_the_weights_changed(
    context: Any, gateway: Service, simulator: Service, tmp_path: Path
) -> None:
    """A weight update mid-answer, then another between turns: the version band names each span and marks the
    switches; the summary gives the versions the trained tokens span (the view's trained_versions)."""
    sid = new_session(gateway, prompt_ids=[1, 2, 3, 4], num_layers=SIM_LAYERS, moe_router_topk=SIM_TOPK)
    generate = {"sampling_params": {"max_new_tokens": 12, "ignore_eos": True}}
    try:
        update = {"weight_version": "ui-v1", "after_tokens": 5}
        assert httpx.post(f"{simulator.url}/sim/weight_version", json=update).status_code == 200
        assert httpx.post(f"{gateway.url}/v1/sessions/{sid}/generate", json=generate).status_code == 200
        tool = {"token_ids": [9, 9, 9]}
        assert httpx.post(f"{gateway.url}/v1/sessions/{sid}/append", json=tool).status_code == 200
        assert httpx.post(f"{simulator.url}/sim/weight_version", json={"weight_version": "ui-v2"}).status_code == 200
        assert httpx.post(f"{gateway.url}/v1/sessions/{sid}/generate", json=generate).status_code == 200
    finally:
        httpx.post(f"{simulator.url}/sim/reset")  # the shared simulator back on its own weights
    trained = view(gateway, sid)["trained_versions"]
    first = trained["first"]
    assert trained["tokens"] == {first: 5, "ui-v1": 7, "ui-v2": 12} and trained["count"] == 3
    page, watch = await open_page(context, f"{gateway.url}/ui/sessions/{sid}")
    assert await text(page, "#count-version-spans") == f"{first} 4–8 · ui-v1 9–15 · ui-v2 19–30"
    assert await text(page, "#count-versions") == (
        f"{first} → ui-v2 (3 versions; trained tokens {first}: 5, ui-v1: 7, ui-v2: 12)"
    )
    switches = await page.evaluate("document.getElementById('tracks-canvas').dataset.versionSwitches")
    assert switches == "9,19"
    await hover_token(page, 12)
    assert await text(page, "#detail-version") == "ui-v1"
    await page.screenshot(path=str(tmp_path / "versions.png"))
    assert watch.errors == [] and watch.dialogs == []
