"""The documentation cannot lie: the site builds strictly, its references match the code, and its curl examples run.

- ``mkdocs build --strict`` (a broken link or anchor, a page left out of the nav, a setting without a description
  fail it), once per run into a temporary folder; the generated references (scripts/docs_hooks.py) are checked
  against what they describe: every setting with its env var and flag, every OpenAPI operation, every metric, every
  name the SDK exports.
- Every fenced ``bash`` block with a ``curl`` in ``docs/`` and the README runs, page by page in order (one shell per
  page, so a session created above is there below), against a real gateway (``--tokenizer``) and simulator
  (4 layers, top-2 of 8 experts) where the page says ``localhost:8000`` and ``localhost:30000``. Every answer must be
  2xx except those the block announces in a comment with their status and error type (``# 409 session_mismatch``),
  in order. ``<!-- curl-test: gateway=keyed -->`` before a block runs it on a gateway with an API key (``$KEY``);
  ``<!-- curl-test: skip REASON -->`` skips one, with the reason shown.
- The prose against the code: the README's and the docs' ``GATEWAY_*`` names are settings, their tables' defaults are
  the settings' defaults, the error table names every error type of ``gateway.errors`` with its status, the README's
  links reach files that exist.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from html import unescape
from pathlib import Path
from types import ModuleType

import httpx
import pytest
import yaml
from conftest import Service, run_gateway
from procs import REPO_ROOT

DOCS = REPO_ROOT / "docs"
README = REPO_ROOT / "README.md"
README_MAX_LINES = 260
BIN = Path(sys.executable).parent
# GATEWAY_* names in the docs that are not gateway settings: the compose file's image variable, the variable the
# harness examples keep the gateway's key in, and docker/haproxy.cfg's replica addresses.
NOT_SETTINGS = frozenset({"GATEWAY_IMAGE", "GATEWAY_KEY", *(f"GATEWAY_REPLICA_{n}" for n in (1, 2, 3))})


def load_hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", REPO_ROOT / "scripts" / "docs_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hooks() -> ModuleType:
    return load_hooks()


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built the way ``make docs`` builds it."""
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [str(BIN / "mkdocs"), "build", "--strict", "--site-dir", str(out)],
        cwd=REPO_ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stdout}\n{built.stderr}"
    return out


def page_html(site: Path, page: str) -> str:
    return (site / page / "index.html").read_text()


# ---- the build and the references ------------------------------------------------------------------------------------
class _ConfigLoader(yaml.SafeLoader):
    """mkdocs.yml as data: the ``!!python/name:`` tags some Markdown extensions take are read as None."""


_ConfigLoader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)


def test_site_builds_strictly_with_every_page_in_the_nav(site: Path) -> None:
    config = yaml.load((REPO_ROOT / "mkdocs.yml").read_text(), Loader=_ConfigLoader)
    nav_pages = set(_nav_pages(config["nav"]))
    written = {str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md")}
    assert written <= nav_pages, f"pages missing from mkdocs.yml's nav: {sorted(written - nav_pages)}"
    for page in nav_pages:
        stem = page.removesuffix(".md")
        built = "index.html" if stem == "index" else stem.removesuffix("/index") + "/index.html"
        assert (site / built).is_file(), f"{page} was not built ({built})"


def _nav_pages(nav: object) -> Iterator[str]:
    if isinstance(nav, str):
        yield nav
    elif isinstance(nav, list):
        for item in nav:
            yield from _nav_pages(item)
    elif isinstance(nav, dict):
        for value in nav.values():
            yield from _nav_pages(value)


def test_settings_reference_has_every_setting(site: Path, hooks: ModuleType) -> None:
    from gateway.__main__ import build_parser
    from gateway.config import Settings

    html = page_html(site, "reference/settings")
    text = " ".join(unescape(re.sub(r"<[^>]+>", " ", html)).split())
    for name, field in Settings.model_fields.items():
        env = f"GATEWAY_{name.upper()}"
        assert f'id="{env.lower()}"' in html, f"{env} has no entry in the settings reference"
        assert field.description, f"Settings.{name} has no description="
        assert " ".join(field.description.split()) in text, f"{env}'s description is not in the settings reference"
    flags = [action.option_strings[0] for action in build_parser()._actions if action.dest != "help"]
    assert len(flags) >= 5
    for flag in flags:
        assert f"<code>{flag}</code>" in html, f"the flag {flag} is not in the settings reference"


def test_http_reference_has_every_operation_and_the_document(site: Path, hooks: ModuleType) -> None:
    document = hooks.openapi_document()
    html = page_html(site, "reference/http")
    operations = [(path, method) for path, ops in document["paths"].items() for method in ops]
    assert len(operations) > 20
    for path, method in operations:
        assert f'id="{hooks._anchor("op", method, path)}"' in html, f"{method.upper()} {path} is not in the reference"
    for name in document["components"]["schemas"]:
        assert f'id="{hooks._anchor("schema", name)}"' in html, f"schema {name} is not in the reference"
    assert json.loads((site / "reference" / "openapi.json").read_text()) == document


def test_metrics_reference_has_every_metric(site: Path) -> None:
    html = page_html(site, "reference/metrics")
    names = re.findall(r'"(gateway_[a-z_]+)"', (REPO_ROOT / "gateway" / "metrics.py").read_text())
    assert len(names) > 10
    for name in names:
        assert f"<code>{name}" in html, f"the metric {name} is not in the metrics reference"


def test_sdk_reference_has_every_exported_name(site: Path, hooks: ModuleType) -> None:
    import slime_client

    html = page_html(site, "reference/sdk")
    sections = dict(hooks.sdk_sections())
    listed = {name for names in sections.values() for name in names}
    assert set(slime_client.__all__) <= listed
    for module, names in sections.items():
        for name in names:
            assert f'id="{module}.{name}"' in html, f"{module}.{name} is not rendered in the SDK reference"
    assert 'id="slime_client.client.Session.fetch_all"' in html  # members are rendered, not only the classes


# ---- curl examples ------------------------------------------------------------------------------------------------
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w-]*)")
DIRECTIVE = re.compile(r"<!--\s*curl-test:\s*(?P<what>.*?)\s*-->")
CURL = re.compile(r"(^|[\s;|&(])curl\s")
# An announced failure: a comment naming the status and the error type the request is meant to get.
ANNOUNCED = re.compile(r"#.*?\b([45]\d\d) ([a-z]+(?:_[a-z]+)*)\b")
STATUS_MARK = "@@curl-status"
BLOCK_MARK = "@@block"


@dataclass
class Block:
    line: int
    text: str
    gateway: str  # "plain" or "keyed"
    skip: str | None


def shell_blocks(path: Path) -> list[Block]:
    """The page's fenced bash blocks that run curl, in order, with the directive just above each."""
    blocks: list[Block] = []
    lines = path.read_text().splitlines()
    directive = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if found := DIRECTIVE.search(line):
            directive = found.group("what")
        match = FENCE.match(line)
        if not match:
            if line.strip() and not found:
                directive = None
            i += 1
            continue
        fence, indent = match.group("fence"), len(match.group("indent"))
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        text = "\n".join(body) + "\n"
        if match.group("lang") in ("bash", "sh", "shell") and CURL.search(text):
            skip = directive.removeprefix("skip").strip() if directive and directive.startswith("skip") else None
            assert skip != "", f"{path}:{i}: a skipped curl example must say why (<!-- curl-test: skip REASON -->)"
            keyed = bool(directive and directive.replace(" ", "") == "gateway=keyed")
            blocks.append(Block(i - len(body), text, "keyed" if keyed else "plain", skip))
        directive = None
        i += 1
    return blocks


def curl_pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _page_id(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT))


PAGES_WITH_CURL = [path for path in curl_pages() if shell_blocks(path)]


def test_the_docs_have_curl_examples_to_run() -> None:
    names = {_page_id(path) for path in PAGES_WITH_CURL}
    assert {"README.md", "docs/getting-started.md", "docs/api/sessions.md", "docs/agents/index.md"} <= names


@pytest.fixture(scope="module")
def docs_key() -> str:
    return secrets.token_hex(16)


@pytest.fixture(scope="module")
def keyed_gateway(chat_sim: Service, docs_key: str) -> Iterator[Service]:
    with run_gateway(chat_sim.url, "--log-level", "warning", env={"GATEWAY_API_KEY": docs_key}) as service:
        yield service


def _rewrite(text: str, gateway: Service, simulator: Service) -> str:
    for host in ("localhost", "127.0.0.1"):
        text = text.replace(f"{host}:8000", f"127.0.0.1:{gateway.port}")
        text = text.replace(f"{host}:30000", f"127.0.0.1:{simulator.port}")
    return text


def _sessions(gateway: Service, key: str | None = None) -> set[str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    answer = httpx.get(f"{gateway.url}/v1/sessions", headers=headers, timeout=10)
    answer.raise_for_status()
    return {item["session_id"] for item in answer.json()["sessions"]}


@pytest.mark.parametrize("page", PAGES_WITH_CURL, ids=_page_id)
def test_curl_examples_run(
    page: Path, chat_sim: Service, chat_gateway: Service, keyed_gateway: Service, docs_key: str, tmp_path: Path
) -> None:
    if shutil.which("curl") is None or shutil.which("bash") is None:
        pytest.skip("the curl examples need curl and bash on PATH")
    blocks = [block for block in shell_blocks(page) if block.skip is None]
    skipped = [f"line {block.line}: {block.skip}" for block in shell_blocks(page) if block.skip is not None]
    if not blocks:
        pytest.skip(f"every curl example of {_page_id(page)} is marked skip: {skipped}")
    targets = {"plain": chat_gateway, "keyed": keyed_gateway}
    before = {name: _sessions(service, docs_key if name == "keyed" else None) for name, service in targets.items()}
    script = [
        "set -eu",
        # Each answer's status on stderr, the body untouched on stdout (pipes and -o work as written).
        f"curl() {{ command curl -w '%{{stderr}}{STATUS_MARK} %{{http_code}}\\n' \"$@\"; }}",
    ]
    for number, block in enumerate(blocks):
        script += [f"echo '{BLOCK_MARK} {number}' >&2", _rewrite(block.text, targets[block.gateway], chat_sim)]
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "KEY": docs_key}
    weight_version = httpx.get(f"{chat_sim.url}/get_model_info", timeout=10).json()["weight_version"]
    try:
        ran = subprocess.run(
            ["bash", "-c", "\n".join(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
    finally:  # what the page changed goes: its sessions, the simulator's scripts and weight version
        httpx.delete(f"{chat_sim.url}/sim/script", timeout=10)
        httpx.post(f"{chat_sim.url}/sim/weight_version", json={"weight_version": weight_version}, timeout=10)
        for name, service in targets.items():
            key = docs_key if name == "keyed" else None
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            for session_id in _sessions(service, key) - before[name]:
                httpx.delete(f"{service.url}/v1/sessions/{session_id}", headers=headers, timeout=10)
    report = f"{_page_id(page)}\n--- stdout ---\n{ran.stdout[-4000:]}\n--- stderr ---\n{ran.stderr[-4000:]}"
    assert ran.returncode == 0, f"a curl example failed (exit {ran.returncode}): {report}"
    statuses = _statuses_per_block(ran.stderr, len(blocks))
    for number, block in enumerate(blocks):
        seen = statuses[number]
        assert seen, f"{_page_id(page)} line {block.line}: the block ran no curl"
        assert "000" not in seen, f"{_page_id(page)} line {block.line}: a request got no answer: {report}"
        failed = [status for status in seen if not status.startswith("2")]
        announced = [status for status, _ in ANNOUNCED.findall(block.text)]
        assert failed == announced, (
            f"{_page_id(page)} line {block.line}: answers {seen}; the block announces failures {announced} "
            f"(write '# STATUS error_type' beside a request meant to fail): {report}"
        )


def _statuses_per_block(stderr: str, blocks: int) -> list[list[str]]:
    statuses: list[list[str]] = [[] for _ in range(blocks)]
    current = -1
    for line in stderr.splitlines():
        if line.startswith(BLOCK_MARK):
            current = int(line.split()[1])
        elif STATUS_MARK in line:
            statuses[current].append(line.split(STATUS_MARK, 1)[1].split()[0])
    return statuses


def test_announced_failures_name_real_error_types() -> None:
    types = {cls.error_type for cls in _error_classes()}
    for page in curl_pages():
        for block in shell_blocks(page):
            for status, error_type in ANNOUNCED.findall(block.text):
                assert error_type in types, (
                    f"{_page_id(page)} line {block.line}: {status} {error_type} is no error type"
                )


# ---- the prose against the code --------------------------------------------------------------------------------------
def prose_files() -> list[Path]:
    return [README, REPO_ROOT / "CONTRIBUTING.md", *sorted(DOCS.rglob("*.md"))]


def test_readme_is_a_short_front_door() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"the README has {len(lines)} lines; move detail into docs/"


def test_readme_links_reach_files_and_headings() -> None:
    text = README.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert len(links) > 10
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        path = (REPO_ROOT / target) if target else README
        assert path.exists(), f"README links to {link}: no such file"
        if anchor and path.suffix == ".md":
            slugs = {_github_slug(heading) for heading in re.findall(r"^#+ (.+)$", path.read_text(), re.MULTILINE)}
            assert anchor in slugs, f"README links to {link}: no such heading in {target or 'README.md'}"


def _github_slug(heading: str) -> str:
    heading = re.sub(r"\{#.*\}$", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def test_settings_named_in_the_docs_exist() -> None:
    from gateway.config import Settings

    settings = {f"GATEWAY_{name.upper()}" for name in Settings.model_fields}
    for path in prose_files():
        named = set(re.findall(r"(?<![A-Z0-9_])GATEWAY_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
        unknown = named - settings - NOT_SETTINGS
        assert not unknown, f"{path.relative_to(REPO_ROOT)} names settings that do not exist: {sorted(unknown)}"


def test_settings_tables_state_the_real_defaults(hooks: ModuleType) -> None:
    defaults = {row["env"]: row["default"] for row in hooks.settings_rows()}
    checked = 0
    for path in prose_files():
        for header, rows in _tables(path.read_text()):
            if "default" not in header:
                continue
            column = header.index("default")
            for row in rows:
                named = re.findall(r"`(GATEWAY_[A-Z0-9_]+)`", row[0])
                if len(named) != 1 or named[0] not in defaults or len(row) <= column:
                    continue
                stated = row[column].replace("`", "").strip()
                assert stated.startswith(defaults[named[0]]), (
                    f"{path.relative_to(REPO_ROOT)}: {named[0]}'s default is {defaults[named[0]]!r}, the table says "
                    f"{stated!r}"
                )
                checked += 1
    assert checked >= 15


def _tables(text: str) -> Iterator[tuple[list[str], list[list[str]]]]:
    rows: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
        elif rows:
            if len(rows) > 2:
                yield rows[0], rows[2:]
            rows = []


def _error_classes() -> list[type]:
    from gateway.errors import GatewayError

    found, todo = [GatewayError], [GatewayError]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__ == "gateway.errors":
                found.append(sub)
                todo.append(sub)
    return found


def test_error_table_names_every_error_type_with_its_status() -> None:
    rows = [row for header, rows in _tables((DOCS / "api" / "errors.md").read_text()) for row in rows]
    for cls in _error_classes():
        where = [row[0] for row in rows if f"`{cls.error_type}`" in row[1]]
        assert where, f"docs/api/errors.md does not list {cls.error_type} ({cls.__name__})"
        assert str(cls.status_code) in where, (
            f"docs/api/errors.md lists {cls.error_type} as {where}, not {cls.status_code}"
        )


def test_pre_commit_runs_ruff_check_and_format() -> None:
    config = REPO_ROOT / ".pre-commit-config.yaml"
    valid = subprocess.run([str(BIN / "pre-commit"), "validate-config", str(config)], capture_output=True, text=True)
    assert valid.returncode == 0, valid.stdout + valid.stderr
    entries = [hook["entry"] for repo in yaml.safe_load(config.read_text())["repos"] for hook in repo["hooks"]]
    assert any(re.search(r"\bruff check\b", entry) for entry in entries)
    assert any(re.search(r"\bruff format\b", entry) and "--check" not in entry for entry in entries)


def test_generated_pages_can_be_written_without_a_build(tmp_path: Path) -> None:
    written = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "docs_hooks.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert written.returncode == 0, written.stderr
    settings = (tmp_path / "reference" / "settings.md").read_text()
    assert "## GATEWAY_STORE {#gateway_store}" in settings
    assert settings.count("\n## GATEWAY_") >= 30
