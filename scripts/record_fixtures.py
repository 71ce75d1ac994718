"""Record a handful of real SGLang `/generate` answers into tests/fixtures/sglang/*.json.

    .venv/bin/python scripts/record_fixtures.py                 # starts the engine of `make test-sglang` itself
    .venv/bin/python scripts/record_fixtures.py --url http://127.0.0.1:18300   # an engine already running

The engine is the CPU build of scripts/real_sglang/ (setup.sh: SGLang 0.5.23, a tiny random Qwen3-MoE with
2 layers, 8 experts, top-2, a 512-token vocabulary) started with --enable-return-routed-experts.
tests/test_sim_fidelity.py compares the simulator's answers with these recordings (keys, types, encodings,
SSE framing), so the simulator can be checked in `make test` without an engine.

Each file holds the request and what came back: `status`, `content_type` and either `json` (the parsed body)
or `sse` (the raw event-stream text, byte for byte).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = REPO_ROOT / "tests" / "fixtures" / "sglang"
SCRIPTS = REPO_ROOT / "scripts" / "real_sglang"
ENGINE_DIR = Path(os.environ.get("SGLANG_DIR", REPO_ROOT / ".sglang-cpu"))
READY_TIMEOUT_S = 180.0
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]  # token ids of the tiny 512-token vocabulary
GREEDY = {"temperature": 0.0}
FULL_LENGTH = {"temperature": 0.0, "ignore_eos": True}  # finish "length" on any engine (or simulator)
ABORT_AFTER_S = 0.6  # the tiny model decodes ~25 tokens/s on 2 CPU cores: a dozen tokens before the abort


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def running_engine() -> Iterator[str]:
    """Start run.sh on a free port, wait for /health, yield the URL, stop it (its log is shown if it fails)."""
    port = free_port()
    args = ["bash", str(SCRIPTS / "run.sh"), str(ENGINE_DIR), str(port), "--enable-return-routed-experts"]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc)
            yield url
        except BaseException:
            log.seek(0)
            print(log.read().decode(errors="replace")[-4000:], file=sys.stderr)
            raise
        finally:
            stop_group(proc)


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the engine's process group (the server and its scheduler/detokenizer children), then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 5.0)):
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def wait_healthy(url: str, proc: subprocess.Popen[bytes]) -> None:
    """One /health at a time: SGLang runs a one-token generation per call, so a fast poll would pile them up."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the engine exited with code {proc.returncode} during startup")
        try:
            if httpx.get(f"{url}/health", timeout=30).status_code == 200:
                return
        except httpx.TransportError:  # not listening yet, or a slow health generation
            pass
        time.sleep(1)
    raise RuntimeError(f"the engine at {url} was not healthy after {READY_TIMEOUT_S} s")


def model_shape(url: str) -> dict[str, Any]:
    config = json.loads((ENGINE_DIR / "model" / "config.json").read_text()) if ENGINE_DIR.exists() else {}
    info = httpx.get(f"{url}/model_info", timeout=10).json()
    version = httpx.get(f"{url}/server_info", timeout=10).json().get("version")
    return {
        "sglang_version": version,
        "model_type": info.get("model_type"),
        "num_layers": config.get("num_hidden_layers", 2),
        "topk": config.get("num_experts_per_tok", 2),
        "num_experts": config.get("num_experts") or config.get("num_local_experts", 8),
        "vocab_size": config.get("vocab_size", 512),
        "launch": "scripts/real_sglang/run.sh DIR PORT --enable-return-routed-experts",
    }


def record(client: httpx.Client, request: dict[str, Any]) -> dict[str, Any]:
    response = client.post("/generate", json=request)
    content_type = response.headers.get("content-type", "")
    answer: dict[str, Any] = {"status": response.status_code, "content_type": content_type}
    if content_type.startswith("text/event-stream"):
        answer["sse"] = response.text
    else:
        answer["json"] = response.json()
    return answer


def record_aborted(client: httpx.Client, request: dict[str, Any]) -> dict[str, Any]:
    """A long request aborted mid-generation through /abort_request (the answer is still a 200)."""
    result: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: result.update(record(client, request)))
    worker.start()
    time.sleep(ABORT_AFTER_S)
    client.post("/abort_request", json={"rid": request["rid"]}).raise_for_status()
    worker.join(60)
    return result


def requests(stop_token: int) -> dict[str, tuple[str, dict[str, Any]]]:
    logprob = {"return_logprob": True}
    routed = {"return_logprob": True, "return_routed_experts": True}
    return {
        "plain": ("return_logprob, greedy, finish by length", {
            "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5, **FULL_LENGTH}, **logprob}),
        "stop": ("finish by a stop token (the greedy run's second token)", {
            "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5, "stop_token_ids": [stop_token], **GREEDY},
            **logprob}),
        "routed_experts": ("return_routed_experts: rows for every position but the last token", {
            "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5, **FULL_LENGTH}, **routed}),
        "start_len": ("routed_experts_start_len 8: only the rows from position 8 on (not echoed back)", {
            "input_ids": [*PROMPT, 9, 10, 11], "sampling_params": {"max_new_tokens": 4, **FULL_LENGTH},
            "routed_experts_start_len": len(PROMPT), **routed}),
        "stream": ("stream: cumulative SSE chunks, routing on the last one, then [DONE]", {
            "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, **FULL_LENGTH}, "stream": True, **routed}),
        "aborted": ("a long request aborted via /abort_request while generating", {
            "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True, **GREEDY},
            "rid": "fixture-aborted", **routed}),
        "error_400": ("no input: HTTP 400", {"sampling_params": {"max_new_tokens": 4}}),
        "stream_error_400": ("no input in a stream: HTTP 200 with the error in-band, then [DONE]", {
            "sampling_params": {"max_new_tokens": 4}, "stream": True}),
    }  # fmt: skip


def record_all(url: str, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    engine = model_shape(url)
    written = []
    with httpx.Client(base_url=url, timeout=120) as client:
        greedy = record(client, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5, **GREEDY}})
        stop_token = greedy["json"]["output_ids"][1]
        for name, (description, request) in requests(stop_token).items():
            answer = record_aborted(client, request) if name == "aborted" else record(client, request)
            fixture = {"name": name, "description": description, "engine": engine, "request": request, **answer}
            path = out_dir / f"{name}.json"
            path.write_text(json.dumps(fixture, indent=1) + "\n")
            written.append(path)
            shown = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path  # --out may be elsewhere
            print(f"{shown}: {answer['status']} {answer['content_type']}")
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="an engine already running with --enable-return-routed-experts")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    if args.url:
        record_all(args.url.rstrip("/"), args.out)
        return
    if not (ENGINE_DIR / "venv").exists():
        sys.exit(f"no engine: run `make test-sglang` (or {SCRIPTS}/setup.sh {ENGINE_DIR}) first, or pass --url")
    with running_engine() as url:
        record_all(url, args.out)


if __name__ == "__main__":
    main()
