"""The OpenAPI document is the API (``gateway.openapi``): what it says of bodies, errors and media types, checked
against the real gateway's answers, and a bounded schemathesis run (the CLI, pinned in the dev extra) with every
check against a real gateway with a tokenizer, in front of the simulator speaking it.

The schemathesis run fails on any 5xx, any answer that does not match the document (status, content type, headers,
body schema), a documented-valid request refused (422) or an invalid one accepted, and on the stateful checks
(a deleted session gone, a created one there). What it is told beyond the document, and why:

- The chat routes answer a request the document allows but the conversation cannot take (a tool result for no
  earlier call, a history ending with the assistant's message, a prompt past the context) with 400
  ``invalid_request_error`` in their API's shape, never 422: 400 is accepted below.
- ``positive_data_acceptance`` also counts as accepted: 400 (``upstream_rejected``: the SGLang upstream refused what
  the gateway's schema allows, e.g. prompt + max_new_tokens past its context length), 413 and 507 (the configured
  limits ``GATEWAY_MAX_SESSION_TOKENS`` / ``GATEWAY_MAX_STORED_BYTES``, not schema rules). The gateway's own
  validation answers 422, which stays a failure for a documented-valid request.
- tests/schemathesis_hooks.py gives generated sessions with a valid MoE shape the simulator's (see there why).

``SCHEMATHESIS_EXAMPLES`` (default 25 per operation) and ``SCHEMATHESIS_SEED`` (default fixed, so a run is
repeatable; ``random`` for a new one) size the run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import SIM_LAYERS, SIM_TOPK, Service, run_gateway, run_simulator
from procs import REPO_ROOT

API_KEY = "openapi-test-key"
AUTH = {"authorization": f"Bearer {API_KEY}"}
CONTEXT_LENGTH = 4096
EXAMPLES = os.environ.get("SCHEMATHESIS_EXAMPLES", "25")
SEED = os.environ.get("SCHEMATHESIS_SEED", "20261201")
ACCEPTED_VALID = ["2xx", "400", "401", "404", "409", "413", "429", "5xx", "507"]


@pytest.fixture(scope="module")
def fuzzed(tokenizer_dir: Path) -> Iterator[Service]:
    """A gateway with a tokenizer and a key, in front of a simulator speaking that tokenizer with a context length
    (so that huge max_new_tokens are the upstream's quick 400, not minutes of generation)."""
    env = {"GATEWAY_API_KEY": API_KEY, "GATEWAY_MAX_SESSION_TOKENS": str(2 * CONTEXT_LENGTH)}
    sim_args = ("--tokenizer", str(tokenizer_dir), "--context-length", str(CONTEXT_LENGTH))
    with run_simulator(*sim_args) as sim, run_gateway(sim.url, "--tokenizer", str(tokenizer_dir), env=env) as gw:
        yield gw


@pytest.fixture(scope="module")
def document(fuzzed: Service) -> dict[str, Any]:
    response = httpx.get(f"{fuzzed.url}/openapi.json", headers=AUTH)
    assert response.status_code == 200
    return response.json()


def operations(document: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in document["paths"].items():
        for method, operation in item.items():
            yield path, method, operation


def resolve(document: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref", "")
    return document["components"]["schemas"][ref.rsplit("/", 1)[-1]] if ref else schema


def validator(document: dict[str, Any], schema: dict[str, Any]) -> Any:
    """A JSON Schema 2020-12 validator of ``schema`` in ``document`` (its $refs resolved in it)."""
    import jsonschema_rs  # schemathesis's own validator

    root = {**schema, "components": document["components"]}
    return jsonschema_rs.Draft202012Validator(root)


# ---- the document ------------------------------------------------------------------------------------------------
def test_every_error_is_declared_with_the_gateway_s_error_schema(document: dict[str, Any]) -> None:
    schemas = document["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "ValidationError" not in schemas  # FastAPI's {"detail": ...}
    checked = 0
    for path, method, operation in operations(document):
        for status, response in operation["responses"].items():
            if status.isdigit() and int(status) >= 400:
                assert response["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorBody"}
                checked += 1
        key_needed = path not in ("/health", "/metrics")  # open to reads (GATEWAY_PROTECT_METRICS is off)
        assert {"500", "503", *(["401"] if key_needed else [])} <= set(operation["responses"]), (path, method)
        assert ("401" in operation["responses"]) is key_needed
    assert checked > 100


def test_request_bodies_are_the_models_the_routes_validate_with(document: dict[str, Any]) -> None:
    def body(path: str) -> dict[str, Any]:
        return document["paths"][path]["post"]["requestBody"]

    expected = {
        "/v1/sessions": ("SessionCreate", False),
        "/v1/sessions/{session_id}/generate": ("TurnCreate", False),
        "/v1/sessions/{session_id}/append": ("ToolAppend", True),
        "/v1/samples": ("SampleBatchRequest", True),
    }
    for path, (model, required) in expected.items():
        assert body(path)["required"] is required
        assert body(path)["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
    schemas = document["components"]["schemas"]
    assert schemas["SessionCreate"]["additionalProperties"] is False  # unknown fields are refused
    assert schemas["ToolAppend"]["required"] == ["token_ids"]
    assert schemas["SamplingParams"]["additionalProperties"] == {"$ref": "#/components/schemas/JsonValue"}


def test_media_types_are_the_real_ones(document: dict[str, Any]) -> None:
    paths = document["paths"]
    turn = paths["/v1/sessions/{session_id}/generate"]["post"]["responses"]["200"]["content"]
    assert set(turn) == {"application/json", "text/event-stream", "application/vnd.safetensors"}
    sample = paths["/v1/sessions/{session_id}/sample"]["get"]["responses"]["200"]["content"]
    assert set(sample) == {"application/vnd.safetensors"}
    assert set(paths["/v1/samples"]["post"]["responses"]["200"]["content"]) == {"application/vnd.safetensors"}
    (metrics,) = paths["/metrics"]["get"]["responses"]["200"]["content"]
    assert metrics.startswith("text/plain; version=")  # Prometheus's text format


def test_passthrough_routes_and_the_key_are_declared(document: dict[str, Any]) -> None:
    from gateway.routes.passthrough import GET_PATHS, POST_PATHS

    for path in POST_PATHS:
        assert "post" in document["paths"][path]
    for path in GET_PATHS:
        assert "get" in document["paths"][path]
    assert document["security"] == [{"bearer": []}, {"x-api-key": []}]
    assert document["paths"]["/health"]["get"]["security"] == []
    assert document["paths"]["/v1/sessions"]["post"].get("security") is None  # the document's: the key


def test_answers_match_their_declared_schemas(fuzzed: Service, document: dict[str, Any]) -> None:
    """A few answers by hand, validated against what the document declares for their status and media type."""

    def check(response: httpx.Response, path: str, method: str) -> None:
        declared = document["paths"][path][method]["responses"][str(response.status_code)]
        media = response.headers["content-type"].split(";")[0]
        schema = declared["content"][media]["schema"]
        if media == "application/json":
            errors = list(validator(document, schema).iter_errors(response.json()))
            assert not errors, (path, method, response.status_code, [str(e) for e in errors])

    with httpx.Client(base_url=fuzzed.url, headers=AUTH, timeout=30) as gw:
        moe = {"num_layers": SIM_LAYERS, "moe_router_topk": SIM_TOPK}
        created = gw.post("/v1/sessions", json={"prompt_ids": [5, 6, 7], **moe})
        check(created, "/v1/sessions", "post")
        sid = created.json()["session_id"]
        check(gw.post(f"/v1/sessions/{sid}/generate", json={}), "/v1/sessions/{session_id}/generate", "post")
        check(
            gw.post(f"/v1/sessions/{sid}/append", json={"token_ids": [9]}), "/v1/sessions/{session_id}/append", "post"
        )
        check(gw.get(f"/v1/sessions/{sid}"), "/v1/sessions/{session_id}", "get")
        check(gw.get("/v1/sessions"), "/v1/sessions", "get")
        check(gw.post(f"/v1/sessions/{sid}/abort"), "/v1/sessions/{session_id}/abort", "post")
        check(gw.get("/health"), "/health", "get")
        check(gw.get("/v1/sessions/nope"), "/v1/sessions/{session_id}", "get")  # 404
        check(gw.post("/v1/sessions", json={"prompt_ids": [-1]}), "/v1/sessions", "post")  # 422
        check(gw.get(f"/v1/sessions/{sid}/sample", params={"branch": 3}), "/v1/sessions/{session_id}/sample", "get")
        unauthorized = httpx.get(f"{fuzzed.url}/v1/sessions")
        check(unauthorized, "/v1/sessions", "get")  # 401


# ---- schemathesis ------------------------------------------------------------------------------------------------
def schemathesis_cli() -> str:
    found = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("schemathesis is not installed (the dev extra pins it: make install)")
    return found


def test_schemathesis_finds_nothing(fuzzed: Service, document: dict[str, Any], tmp_path: Path) -> None:
    cli = schemathesis_cli()
    (tmp_path / "openapi.json").write_text(json.dumps(document))
    (tmp_path / "schemathesis.toml").write_text(
        f"[checks.positive_data_acceptance]\nexpected-statuses = {json.dumps(ACCEPTED_VALID)}\n"
    )
    seed = [] if SEED == "random" else ["--seed", SEED]
    args = [
        cli, "--config-file", str(tmp_path / "schemathesis.toml"), "--no-color",
        "run", str(tmp_path / "openapi.json"), "--url", fuzzed.url, "--header", f"Authorization: Bearer {API_KEY}",
        "--checks", "all", "--max-examples", EXAMPLES, *seed, "--workers", "1",
        "--generation-database", "none", "--output-sanitize", "false",
        "--report", "junit", "--report-dir", str(tmp_path / "report"),
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
        "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
        "SIM_LAYERS": str(SIM_LAYERS),
        "SIM_TOPK": str(SIM_TOPK),
    }
    run = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900, check=False)
    output = run.stdout + run.stderr
    summary = output[output.rfind("SUMMARY") :] if "SUMMARY" in output else output[-3000:]
    print(f"\nschemathesis {' '.join(args[4:])}\n{summary}")
    assert run.returncode == 0, output[-20000:]
    tested = re.search(r"Tested: (\d+)", output)
    assert tested is not None and int(tested.group(1)) == len(list(operations(document)))  # every operation ran
