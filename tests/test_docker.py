"""The sidecar image (docker/Dockerfile) and compose file, against a real Docker engine: `make test-docker`.

Opt-in (marker `docker`, excluded from `make test`). `make test-docker` starts the engine if needed
(scripts/docker_engine.sh), builds the image (`make image`) and runs this file; by hand:
`GATEWAY_IMAGE=slime-gateway:latest pytest -m docker tests/test_docker.py`. Without a Docker engine or the image
every test here is skipped.

Containers run with `--network host` (this machine has no bridge networking), so a container reaches the
simulator that the `simulator` fixture starts on the host's 127.0.0.1, and the host reaches the container's
gateway on a free host port.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import SIM_LAYERS, SIM_TOPK, Service
from procs import REPO_ROOT, free_port

pytestmark = pytest.mark.docker

IMAGE = os.environ.get("GATEWAY_IMAGE", "slime-gateway:latest")
# The compose demo's router container only needs python3 with venv + pip, like the gateway image's base. Without
# ROUTER_IMAGE: the official base if it is here, else the debootstrap-built one (scripts/docker_engine.sh).
OFFICIAL_BASE_IMAGE = "python:3.11-slim"
LOCAL_BASE_IMAGE = os.environ.get("LOCAL_BASE_IMAGE", "local/debian-python:bookworm")
# The compose file's Redis: Docker Hub's, or the one scripts/docker_engine.sh builds where Hub cannot be reached.
OFFICIAL_REDIS_IMAGE = "redis:7"
LOCAL_REDIS_IMAGE = os.environ.get("LOCAL_REDIS_IMAGE", "local/redis:7")
COMPOSE_FILE = REPO_ROOT / "docker" / "compose.yaml"
HEALTHY_TIMEOUT_S = 60.0
STOP_GRACE_S = 10  # `docker stop -t`: SIGTERM, then SIGKILL after this many seconds
SLOW_TURN_DELAY_S = 2.0  # the simulator's delay fault: long enough that SIGTERM lands mid-turn
ROUTER_READY_TIMEOUT_S = 240.0  # the compose router pip-installs smg when it starts
CURL_TIMEOUT_S = 30
# The image listens on 0.0.0.0, so the gateway only starts with a key (docs/operations/security.md).
API_KEY = "docker-test-key-7f3a"
AUTH = {"authorization": f"Bearer {API_KEY}"}


# ---- helpers ------------------------------------------------------------------------------------------------
def docker(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check, timeout=timeout)


def log(message: str) -> None:
    """Progress lines (shown with `pytest -s`, which `make test-docker` uses)."""
    print(f"[docker] {message}", flush=True)


def container_state(name: str) -> dict[str, Any]:
    return json.loads(docker("inspect", "-f", "{{json .State}}", name).stdout)


def wait_container_healthy(name: str, timeout: float = HEALTHY_TIMEOUT_S) -> float:
    """Poll `docker inspect` until the image's HEALTHCHECK says healthy; returns the seconds it took."""
    started = time.monotonic()
    while True:
        state = container_state(name)
        health = (state.get("Health") or {}).get("Status")
        if health == "healthy":
            return time.monotonic() - started
        if not state.get("Running"):
            pytest.fail(f"container {name} stopped (exit code {state.get('ExitCode')}) before it was healthy")
        if time.monotonic() - started > timeout:
            pytest.fail(f"container {name} not healthy after {timeout} s (health: {health})")
        time.sleep(0.25)


@dataclass
class Container:
    name: str
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def logs(self) -> str:
        result = docker("logs", self.name, check=False)
        return result.stdout + result.stderr


@contextmanager
def run_gateway_container(
    upstream_url: str, *, health_interval: str = "1s", extra: Sequence[str] = ()
) -> Iterator[Container]:
    """`docker run` the image as the sidecar (host network, a free port), wait until healthy, remove it after.
    ``extra``: more `docker run` options (volumes, environment)."""
    container = Container(f"slime-gw-test-{uuid.uuid4().hex[:8]}", free_port())
    docker(
        "run", "--detach", "--name", container.name, "--network", "host",
        "--env", f"GATEWAY_PORT={container.port}",
        "--env", f"GATEWAY_UPSTREAM_URL={upstream_url}",
        "--env", f"GATEWAY_API_KEY={API_KEY}",
        # A short health interval for the test (the image's default is 10 s).
        "--health-interval", health_interval, "--health-timeout", "2s", "--health-retries", "3",
        *extra,
        IMAGE,
    )  # fmt: skip
    try:
        took = wait_container_healthy(container.name)
        log(f"container {container.name} healthy after {took:.1f} s on {container.url}")
        yield container
    except BaseException:
        print(f"--- docker logs {container.name} ---\n{container.logs()}")
        raise
    finally:
        docker("rm", "--force", container.name, check=False)


@dataclass
class CurlResult:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)

    def json(self) -> Any:
        return json.loads(self.body)


def curl(
    method: str, url: str, body: Any = None, *, output: Path | None = None, key: str | None = API_KEY
) -> CurlResult:
    """One request with the curl binary (what a user of the sidecar types), the status read from `-w`."""
    args = ["curl", "-sS", "-X", method, "--max-time", str(CURL_TIMEOUT_S), "-w", "\n%{http_code}", url]
    if key is not None:
        args += ["-H", f"Authorization: Bearer {key}"]
    if body is not None:
        args += ["-H", "content-type: application/json", "--data-binary", json.dumps(body)]
    if output is not None:
        args += ["-o", str(output)]
    result = subprocess.run(args, capture_output=True, check=False, timeout=CURL_TIMEOUT_S + 5)
    assert result.returncode == 0, f"curl {method} {url} failed: {result.stderr.decode(errors='replace')}"
    payload, _, status = result.stdout.rpartition(b"\n")
    return CurlResult(int(status), payload if output is None else output.read_bytes())


def pick_image(env_var: str, official: str, local: str) -> str:
    """An image for the compose file: ``env_var`` when set, else the official one if it is here, else the local
    stand-in (scripts/docker_engine.sh builds it where Docker Hub cannot be reached) if it is here, else the
    official one (compose pulls it)."""
    if chosen := os.environ.get(env_var):
        return chosen
    for candidate in (official, local):
        if docker("image", "inspect", candidate, check=False).returncode == 0:
            return candidate
    return official


def router_image() -> str:
    return pick_image("ROUTER_IMAGE", OFFICIAL_BASE_IMAGE, LOCAL_BASE_IMAGE)


def compose_command() -> list[str] | None:
    """`docker compose` (v2 plugin) or `docker-compose` (1.28+, has profiles), whichever this machine has."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True, check=False).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


# ---- fixtures -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def docker_image() -> str:
    """Skip everything here unless a Docker engine answers and the image exists; log the image's size."""
    if shutil.which("docker") is None:
        pytest.skip("no docker CLI (make test-docker installs and starts an engine)")
    if docker("info", check=False, timeout=30).returncode != 0:
        pytest.skip("the Docker engine does not answer (make test-docker starts one: scripts/docker_engine.sh)")
    if docker("image", "inspect", IMAGE, check=False).returncode != 0:
        pytest.skip(f"image {IMAGE} not built (make image)")
    size = int(docker("image", "inspect", "-f", "{{.Size}}", IMAGE).stdout)
    log(f"image {IMAGE}: {size} bytes ({size / 1e6:.1f} MB)")
    return IMAGE


@pytest.fixture(scope="module")
def sidecar(simulator: Service) -> Iterator[Container]:
    """One gateway container for the read-only / session tests, pointed at the host's simulator."""
    with run_gateway_container(simulator.url) as container:
        yield container


# ---- the image itself ---------------------------------------------------------------------------------------
def test_image_config() -> None:
    config = json.loads(docker("image", "inspect", "-f", "{{json .Config}}", IMAGE).stdout)
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["GATEWAY_HOST"] == "0.0.0.0" and env["GATEWAY_PORT"] == "8000"
    assert "GATEWAY_UPSTREAM_URL" not in env and "GATEWAY_API_KEY" not in env  # required: given at run time
    assert "8000/tcp" in config["ExposedPorts"]
    assert config["Entrypoint"] == ["python", "-m", "gateway"]  # exec form: python is PID 1, gets SIGTERM
    assert config["StopSignal"] == "SIGTERM"
    assert "/health" in " ".join(config["Healthcheck"]["Test"])


def test_image_runs_as_non_root() -> None:
    uid = docker("run", "--rm", "--network", "host", "--entrypoint", "id", IMAGE, "-u").stdout.strip()
    assert uid != "0", "the image must not run as root"


def test_image_has_no_torch_but_has_the_gateway() -> None:
    run = ["run", "--rm", "--network", "host", "--entrypoint", "python", IMAGE, "-c"]
    torch = docker(*run, "import torch", check=False)
    assert torch.returncode != 0 and "No module named 'torch'" in torch.stderr
    ok = docker(*run, "import gateway, numpy, uvicorn; print(gateway.__version__)", check=False)
    assert ok.returncode == 0, ok.stderr


def test_image_has_the_chat_and_redis_extras() -> None:
    """The chat extra (transformers' tokenizers and templates, its model code trimmed: no torch to run it) and the
    redis extra (with async-timeout, which redis needs on the image's Python below 3.11.3) import in the image."""
    code = (
        "import sys, jinja2, redis, hiredis, tokenizers, transformers\n"
        "from transformers import AutoTokenizer\n"
        "from transformers.models.qwen2 import tokenization_qwen2\n"
        "from transformers.models.llama import tokenization_llama\n"
        "if sys.version_info < (3, 11, 3): import async_timeout\n"
        "print(sys.version.split()[0], transformers.__version__, redis.__version__)"
    )
    run = docker("run", "--rm", "--network", "host", "--entrypoint", "python", IMAGE, "-c", code, check=False)
    assert run.returncode == 0, run.stderr
    log(f"image python / transformers / redis: {run.stdout.strip()}")


def test_missing_upstream_url_exits_with_a_message() -> None:
    result = docker("run", "--rm", "--network", "host", IMAGE, check=False)
    assert result.returncode != 0
    assert "upstream_url" in result.stdout + result.stderr


def test_no_api_key_refuses_to_start(simulator: Service) -> None:
    """The image listens on 0.0.0.0: without a key the gateway exits with a message instead of serving everyone."""
    run = ["run", "--rm", "--network", "host", "--env", f"GATEWAY_UPSTREAM_URL={simulator.url}"]
    result = docker(*run, "--env", f"GATEWAY_PORT={free_port()}", IMAGE, check=False)
    assert result.returncode != 0
    assert "refusing to listen on '0.0.0.0' without an API key" in result.stdout + result.stderr


# ---- the sidecar at work ------------------------------------------------------------------------------------
def test_multi_turn_session_with_curl(sidecar: Container, tmp_path: Path) -> None:
    gw = sidecar.url
    health = curl("GET", f"{gw}/health", key=None)  # open: what the HEALTHCHECK calls
    assert health.status == 200 and health.json()["status"] == "ok" and health.json()["instance_id"]
    refused = curl("GET", f"{gw}/v1/sessions", key=None)
    assert refused.status == 401 and refused.json()["error"]["type"] == "unauthorized"

    created = curl(
        "POST", f"{gw}/v1/sessions",
        {"prompt_ids": [1, 2, 3, 4], "num_layers": SIM_LAYERS, "moe_router_topk": SIM_TOPK},
    )  # fmt: skip
    assert created.status == 201, created.body
    sid = created.json()["session_id"]
    turn_body = {"sampling_params": {"max_new_tokens": 6, "custom_params": {"return_top_p_token_ids": True}}}
    first = curl("POST", f"{gw}/v1/sessions/{sid}/generate", turn_body)
    assert first.status == 200, first.body
    appended = curl("POST", f"{gw}/v1/sessions/{sid}/append", {"token_ids": [50, 51, 52], "text": "<tool>ok</tool>"})
    assert appended.status == 200, appended.body
    second = curl("POST", f"{gw}/v1/sessions/{sid}/generate", {"sampling_params": {"max_new_tokens": 6}})
    assert second.status == 200, second.body

    view = curl("GET", f"{gw}/v1/sessions/{sid}")
    assert view.status == 200 and view.json()["turns"]
    model_tokens = len(first.json()["new_token_ids"]) + len(second.json()["new_token_ids"])
    total = 4 + model_tokens + 3

    from safetensors.numpy import load_file

    sample_path = tmp_path / "sample.safetensors"
    sample = curl("GET", f"{gw}/v1/sessions/{sid}/sample", output=sample_path)
    assert sample.status == 200
    tensors = load_file(str(sample_path))
    assert len(tensors["tokens"]) == total
    assert int(tensors["loss_mask"].sum()) == model_tokens and len(tensors["loss_mask"]) == total - 4
    assert tensors["rollout_routed_experts"].shape == (total - 1, SIM_LAYERS, SIM_TOPK)
    log(f"curl session {sid}: {total} tokens, {model_tokens} trainable, sample {len(sample.body)} bytes")
    assert curl("DELETE", f"{gw}/v1/sessions/{sid}").status == 204


async def test_multi_turn_session_with_the_sdk(sidecar: Container) -> None:
    try:
        from slime_client import GatewayClient
    except ImportError as exc:  # the SDK is optional for the image tests
        pytest.skip(f"slime_client not importable: {exc}")

    async with GatewayClient(sidecar.url, api_key=API_KEY) as gw:
        session = await gw.create_session(prompt_ids=[5, 6, 7], num_layers=SIM_LAYERS, moe_router_topk=SIM_TOPK)
        first = await session.generate({"max_new_tokens": 5})
        await session.append([60, 61])
        second = await session.generate({"max_new_tokens": 5})
        sample = await session.fetch()
        sample.check_invariants()
        assert len(sample.tokens) == 3 + len(first.new_token_ids) + 2 + len(second.new_token_ids)
        assert sample.rollout_routed_experts is not None
        assert tuple(sample.rollout_routed_experts.shape) == (len(sample.tokens) - 1, SIM_LAYERS, SIM_TOPK)
        log(f"SDK session {session.session_id}: {len(sample.tokens)} tokens, status {sample.status}")
        await session.delete()


def test_chat_completion_with_a_mounted_tokenizer(chat_sim: Service, tokenizer_dir: Path) -> None:
    """The chat extra at work: the tokenizer directory mounted read-only (readable by the image's uid 10001), an
    OpenAI chat completion over a session, answered from the simulator speaking that tokenizer."""
    mounted = Path(tempfile.mkdtemp(prefix="slime-gw-tokenizer-"))
    try:
        shutil.copytree(tokenizer_dir, mounted, dirs_exist_ok=True)
        for path in [mounted, *mounted.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        volume = ["--volume", f"{mounted}:/tokenizer:ro", "--env", "GATEWAY_TOKENIZER=/tokenizer"]
        with run_gateway_container(chat_sim.url, extra=volume) as container:
            gw = container.url
            assert curl("POST", f"{gw}/v1/sessions", {"session_id": "chat-0"}).status == 201
            body = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hello there"}]}
            answer = curl("POST", f"{gw}/v1/sessions/chat-0/chat/completions", body)
            assert answer.status == 200, answer.body
            assert answer.json()["choices"][0]["message"]["role"] == "assistant"
            view = curl("GET", f"{gw}/v1/sessions/chat-0").json()
            assert view["prompt_length"] > 0 and view["response_length"] > 0
            log(f"chat in the image: prompt {view['prompt_length']} tokens, answer {view['response_length']}")
    finally:
        shutil.rmtree(mounted, ignore_errors=True)


# ---- graceful shutdown --------------------------------------------------------------------------------------
def test_sigterm_lets_the_turn_in_flight_finish(simulator: Service) -> None:
    """`docker stop` (SIGTERM) while a turn is running: the turn still gets its full answer, exit code 0."""
    with run_gateway_container(simulator.url) as container, httpx.Client(timeout=30) as client:
        created = client.post(f"{container.url}/v1/sessions", json={"prompt_ids": [1, 2, 3]}, headers=AUTH)
        sid = created.json()["session_id"]
        client.delete(f"{simulator.url}/sim/requests").raise_for_status()
        fault = {"mode": "delay", "delay_s": SLOW_TURN_DELAY_S}
        client.post(f"{simulator.url}/sim/faults", json=fault).raise_for_status()
        try:
            outcome: dict[str, Any] = {}

            def slow_turn() -> None:
                try:
                    with httpx.Client(timeout=30, headers=AUTH) as own:
                        outcome["response"] = own.post(
                            f"{container.url}/v1/sessions/{sid}/generate",
                            json={"sampling_params": {"max_new_tokens": 4}},
                        )
                except httpx.HTTPError as exc:
                    outcome["error"] = exc

            turn = threading.Thread(target=slow_turn)
            turn.start()
            deadline = time.monotonic() + 10
            while not client.get(f"{simulator.url}/sim/requests").json():  # the turn reached the upstream
                assert time.monotonic() < deadline, "the turn never reached the simulator"
                time.sleep(0.05)

            started = time.monotonic()
            docker("stop", "-t", str(STOP_GRACE_S), container.name, timeout=STOP_GRACE_S + 30)
            took = time.monotonic() - started
            turn.join(30)
        finally:
            client.delete(f"{simulator.url}/sim/faults")

        state = container_state(container.name)
        log(f"docker stop took {took:.1f} s (grace {STOP_GRACE_S} s), exit code {state['ExitCode']}")
        assert "error" not in outcome, f"the in-flight turn was cut: {outcome.get('error')!r}"
        response: httpx.Response = outcome["response"]
        assert response.status_code == 200, response.text
        assert response.json()["finish_reason"] is not None  # a complete turn summary, not a partial body
        assert took < STOP_GRACE_S, "the gateway did not exit within the grace period (it was SIGKILLed)"
        assert state["ExitCode"] == 0 and not state["OOMKilled"]
        assert "Finished server process" in container.logs()


# ---- compose ------------------------------------------------------------------------------------------------
def _compose(project: str, env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    command = compose_command()
    assert command is not None
    return subprocess.run(
        [*command, "--project-name", project, "--file", str(COMPOSE_FILE), *args],
        capture_output=True, text=True, check=False, timeout=timeout, env={**os.environ, **env},
    )  # fmt: skip


@pytest.mark.parametrize(
    "profiles",
    [(), ("demo",), ("gpu",), ("redis",), ("fleet",), ("demo", "fleet")],
    ids=["sidecar-only", "demo", "gpu", "redis", "fleet", "demo-fleet"],
)
def test_compose_file_is_valid(profiles: Sequence[str]) -> None:
    if compose_command() is None:
        pytest.skip("no docker compose / docker-compose")
    flags = [arg for profile in profiles for arg in ("--profile", profile)]
    result = _compose("slime-gw-config", {}, *flags, "config", "--quiet")
    assert result.returncode == 0, result.stderr


def test_compose_demo_profile_gateway_router_simulator() -> None:
    """`--profile demo`: the gateway -> the smg router (pip-installed when it starts) -> the simulator."""
    if compose_command() is None:
        pytest.skip("no docker compose / docker-compose")
    ports = {name: free_port() for name in ("GATEWAY_PORT", "ROUTER_PORT", "WORKER_PORT", "ROUTER_PROMETHEUS_PORT")}
    env = {name: str(port) for name, port in ports.items()}
    env |= {
        "GATEWAY_IMAGE": IMAGE,
        "ROUTER_IMAGE": router_image(),
        "GATEWAY_UPSTREAM_URL": f"http://127.0.0.1:{ports['ROUTER_PORT']}",
        "GATEWAY_API_KEY": API_KEY,
    }
    project = f"slime-gw-demo-{uuid.uuid4().hex[:6]}"
    gateway = f"http://127.0.0.1:{ports['GATEWAY_PORT']}"
    try:
        up = _compose(project, env, "--profile", "demo", "up", "--detach")
        assert up.returncode == 0, up.stderr
        started = time.monotonic()
        ids = _compose(project, env, "--profile", "demo", "ps", "--quiet").stdout.split()
        assert len(ids) == 3, f"expected gateway, router and simulator, got {ids}"
        for container_id in ids:
            wait_container_healthy(container_id, timeout=ROUTER_READY_TIMEOUT_S)
        took = time.monotonic() - started
        log(f"compose demo ({project}) healthy after {took:.1f} s (router image {env['ROUTER_IMAGE']})")

        created = curl("POST", f"{gateway}/v1/sessions", {"prompt_ids": [1, 2, 3], "num_layers": SIM_LAYERS,
                                                          "moe_router_topk": SIM_TOPK})  # fmt: skip
        assert created.status == 201, created.body
        sid = created.json()["session_id"]
        for _ in range(2):  # routing replay through the router: smg forwards return_routed_experts
            turn = curl("POST", f"{gateway}/v1/sessions/{sid}/generate", {"sampling_params": {"max_new_tokens": 4}})
            assert turn.status == 200, turn.body
            assert turn.json()["routed_experts_rows"] == turn.json()["total_tokens"] - 1
    except BaseException:
        print(_compose(project, env, "--profile", "demo", "logs", "--no-color", "--tail", "50").stdout)
        raise
    finally:
        _compose(project, env, "--profile", "demo", "down", "--timeout", "10")


def redis_image() -> str:
    """The compose file's Redis: REDIS_IMAGE, else redis:7 if it is here, else the one scripts/docker_engine.sh
    builds from Debian's redis-server."""
    return pick_image("REDIS_IMAGE", OFFICIAL_REDIS_IMAGE, LOCAL_REDIS_IMAGE)


def test_compose_redis_profile_session_survives_a_gateway_restart(simulator: Service, tmp_path: Path) -> None:
    """`--profile redis` with GATEWAY_STORE on it: a session, its turns and its sample outlive the gateway
    container (restarted: a new process, a new instance id) and the next turn continues it."""
    if compose_command() is None:
        pytest.skip("no docker compose / docker-compose")
    ports = {name: free_port() for name in ("GATEWAY_PORT", "REDIS_PORT")}
    env = {name: str(port) for name, port in ports.items()}
    env |= {
        "GATEWAY_IMAGE": IMAGE,
        "REDIS_IMAGE": redis_image(),
        "GATEWAY_UPSTREAM_URL": simulator.url,
        "GATEWAY_API_KEY": API_KEY,
        "GATEWAY_STORE": f"redis://127.0.0.1:{ports['REDIS_PORT']}/0",
    }
    project = f"slime-gw-redis-{uuid.uuid4().hex[:6]}"
    gateway = f"http://127.0.0.1:{ports['GATEWAY_PORT']}"
    compose = functools.partial(_compose, project, env, "--profile", "redis")
    try:
        up = compose("up", "--detach")
        assert up.returncode == 0, up.stderr
        ids = compose("ps", "--quiet").stdout.split()
        assert len(ids) == 2, f"expected the gateway and redis, got {ids}"
        for container_id in ids:
            wait_container_healthy(container_id)
        gateway_id = compose("ps", "--quiet", "gateway").stdout.strip()
        first_instance = curl("GET", f"{gateway}/health", key=None).json()["instance_id"]

        moe = {"num_layers": SIM_LAYERS, "moe_router_topk": SIM_TOPK}
        created = curl("POST", f"{gateway}/v1/sessions", {"prompt_ids": [1, 2, 3], "session_id": "kept", **moe})
        assert created.status == 201, created.body
        turn = curl("POST", f"{gateway}/v1/sessions/kept/generate", {"sampling_params": {"max_new_tokens": 4}})
        assert turn.status == 200, turn.body
        before = curl("GET", f"{gateway}/v1/sessions/kept?full=true").json()
        sample_before = curl("GET", f"{gateway}/v1/sessions/kept/sample", output=tmp_path / "before.safetensors")

        started = time.monotonic()
        restart = compose("restart", "gateway")
        assert restart.returncode == 0, restart.stderr
        wait_container_healthy(gateway_id)
        log(f"compose redis ({project}, {env['REDIS_IMAGE']}): gateway restarted, healthy after "
            f"{time.monotonic() - started:.1f} s")  # fmt: skip
        assert curl("GET", f"{gateway}/health", key=None).json()["instance_id"] != first_instance  # a new process

        after = curl("GET", f"{gateway}/v1/sessions/kept?full=true").json()
        # Every array, the turn log and the text as they were (not the buffers' spare room, nor the last touch).
        volatile = ("stored_bytes", "updated_at")
        assert {k: v for k, v in after.items() if k not in volatile} == {
            k: v for k, v in before.items() if k not in volatile
        }
        sample_after = curl("GET", f"{gateway}/v1/sessions/kept/sample", output=tmp_path / "after.safetensors")
        assert sample_after.body == sample_before.body
        turn = curl("POST", f"{gateway}/v1/sessions/kept/generate", {"sampling_params": {"max_new_tokens": 4}})
        assert turn.status == 200, turn.body
        assert turn.json()["total_tokens"] == before["total_tokens"] + len(turn.json()["new_token_ids"])
        assert turn.json()["routed_experts_rows"] == turn.json()["total_tokens"] - 1
    except BaseException:
        print(compose("logs", "--no-color", "--tail", "50").stdout)
        raise
    finally:
        compose("down", "--timeout", "10")
