"""Replicas behind a real load balancer: HAProxy (Debian's, ``make haproxy``) with the deployment's own configuration
(docker/haproxy.cfg), three gateway replicas on one Redis, as plain processes on loopback.

- a session's requests all go to one replica (the hash of its id, consistent), and to another one when it dies;
- a replica stopped with SIGTERM drains: its health check fails at once so HAProxy moves its traffic, it serves what
  it still gets (a stream in flight ends whole), then exits; a rolling restart of every replica loses no request;
- the client's key goes through HAProxy to the replicas, which check it; a replica on a reachable address refuses to
  start without one, whatever its store.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RedisServer, Service, run_simulator
from fleet import HAProxy, Replica, haproxy, health
from procs import REPO_ROOT, free_port

PROMPT = list(range(10, 30))
GENERATE_ROUTE = 'route="/v1/sessions/{session_id}/generate"'


@pytest.fixture(scope="module")
def paced(simulator: Service) -> Iterator[Service]:
    """A simulator whose tokens come 20 ms apart: a long answer is a stream that outlasts a replica's drain."""
    with run_simulator("--token-delay-ms", "20") as service:
        yield service


def fleet_env(url: str, **extra: str) -> dict[str, str]:
    return {
        "GATEWAY_STORE": url,
        "GATEWAY_REDIS_PREFIX": f"fleet-{uuid.uuid4().hex[:6]}",
        "GATEWAY_REDIS_HEARTBEAT_S": "0.3",
        "GATEWAY_DRAIN_S": "2",
        "GATEWAY_LOG_LEVEL": "warning",
        **extra,
    }


@contextmanager
def fleet(
    simulator: Service, url: str, directory: Path, count: int = 3, **extra: str
) -> Iterator[tuple[HAProxy, list[Replica]]]:
    env = fleet_env(url, **extra)
    replicas = [Replica(f"gw{n}", free_port(), ("--upstream-url", simulator.url), env) for n in range(1, count + 1)]
    with ExitStack() as stack:
        for replica in replicas:
            replica.start()
            stack.callback(replica.stop)
        with haproxy(replicas, directory) as proxy:
            yield proxy, replicas


def served_turns(replica: Replica) -> float:
    """The turns this replica answered, from its own metrics."""
    text = httpx.get(f"{replica.url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("gateway_requests_total{") and GENERATE_ROUTE in line and 'status="200"' in line
    )


def create(url: str, headers: dict[str, str] | None = None, *, resume: bool = False) -> str:
    sid = f"fleet-{uuid.uuid4().hex[:10]}"
    body: dict[str, Any] = {"session_id": sid, "prompt_ids": PROMPT, "resume": resume}
    created = httpx.post(f"{url}/v1/sessions", json=body, headers=headers, timeout=30)
    assert created.status_code == 201, created.text
    return sid


def turn(url: str, sid: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    answer = httpx.post(f"{url}/v1/sessions/{sid}/generate", json={}, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_sessions_requests_go_to_one_replica_and_move_when_it_dies(
    simulator: Service, redis_server: RedisServer, tmp_path: Path
) -> None:
    with fleet(simulator, redis_server.url, tmp_path) as (proxy, replicas):
        sids = [create(proxy.url) for _ in range(6)]
        for sid in sids:
            before = [served_turns(r) for r in replicas]
            for _ in range(4):
                turn(proxy.url, sid)
            grew = [served_turns(r) - b for r, b in zip(replicas, before, strict=True)]
            assert sorted(grew) == [0, 0, 4], grew  # all four on one replica
        # The replica of the first session dies between its turns: its next turns go elsewhere, without an error
        # (HAProxy's connection to the dead one fails before anything is sent, and it tries another).
        before = [served_turns(r) for r in replicas]
        turn(proxy.url, sids[0])
        owner = next(r for r, b in zip(replicas, before, strict=True) if served_turns(r) > b)
        owner.kill()
        totals = [turn(proxy.url, sids[0])["total_tokens"] for _ in range(3)]
        assert totals == sorted(totals) and len(set(totals)) == 3  # each turn on the one before, none lost
        proxy.wait_for({owner.name: "DOWN"})
        view = httpx.get(f"{proxy.url}/v1/sessions/{sids[0]}", timeout=30).json()
        assert view["turns"] == 4 + 1 + 3


def test_a_sigterm_drains_first_and_a_rolling_restart_loses_nothing(
    paced: Service, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Each replica in turn: SIGTERM (its /health answers 503 at once, HAProxy takes it out, a stream it runs
    ends whole), then started again; meanwhile a client keeps running turns through HAProxy: none fails."""
    long_answer = {"stream": True, "sampling_params": {"max_new_tokens": 200}}  # 4 s: past the 2 s drain
    with fleet(paced, redis_server.url, tmp_path) as (proxy, replicas):
        sids = [create(proxy.url) for _ in range(4)]
        failures: list[str] = []
        done = 0
        stop = False

        def keep_turning() -> None:
            nonlocal done
            while not stop:
                for sid in sids:
                    answer = httpx.post(f"{proxy.url}/v1/sessions/{sid}/generate", json={}, timeout=60)
                    if answer.status_code != 200:
                        failures.append(f"{answer.status_code} {answer.text[:200]}")
                    done += 1

        with ThreadPoolExecutor(2) as pool:
            load = pool.submit(keep_turning)
            for replica in replicas:
                with httpx.Client(timeout=60) as client:
                    sid = create(replica.url)
                    with client.stream("POST", f"{replica.url}/v1/sessions/{sid}/generate", json=long_answer) as s:
                        assert s.status_code == 200
                        stopping = pool.submit(replica.terminate)
                        deadline = time.monotonic() + 10
                        while health(replica.url) != 503:
                            assert time.monotonic() < deadline, "the replica's health check did not fail"
                            time.sleep(0.05)
                        proxy.wait_for({replica.name: "DOWN"})
                        streamed = b"".join(s.iter_raw())
                    assert b'"type":"turn"' in streamed and streamed.endswith(b"data: [DONE]\n\n")
                    stopping.result()
                replica.start()
                proxy.wait_for({replica.name: "UP"})
            stop = True
            load.result()
        assert not failures, failures
        assert done > 0


def test_the_clients_key_goes_through_to_replicas_that_check_it(
    simulator: Service, redis_server: RedisServer, tmp_path: Path
) -> None:
    key = "fleet-key-" + uuid.uuid4().hex
    with fleet(simulator, redis_server.url, tmp_path, GATEWAY_API_KEY=key) as (proxy, _):
        missing = httpx.post(f"{proxy.url}/v1/sessions", json={"prompt_ids": PROMPT}, timeout=30)
        assert missing.status_code == 401 and missing.json()["error"]["type"] == "unauthorized"
        wrong = httpx.get(f"{proxy.url}/v1/sessions", headers={"Authorization": "Bearer nope"}, timeout=30)
        assert wrong.status_code == 401
        sid = create(proxy.url, headers={"Authorization": f"Bearer {key}"})
        turn(proxy.url, sid, headers={"x-api-key": key})  # Anthropic clients' header
        assert httpx.get(f"{proxy.url}/health", timeout=30).status_code == 200  # open, for the health checks


def test_a_replica_on_a_reachable_address_refuses_to_start_without_a_key(redis_server: RedisServer) -> None:
    """Sharing a Redis store changes nothing: without GATEWAY_API_KEY a replica listening on 0.0.0.0 exits."""
    env = {"GATEWAY_STORE": redis_server.url, "GATEWAY_HOST": "0.0.0.0", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "--upstream-url", "http://127.0.0.1:9", "--port", str(free_port())],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and re.search(r"refusing to listen on '0\.0\.0\.0' without an API key", done.stderr)


def test_the_deployment_files_run_the_tested_configuration() -> None:
    """The compose profile mounts docker/haproxy.cfg, the file these tests run, and names every replica in it."""
    import yaml

    compose = yaml.safe_load((REPO_ROOT / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    proxy = services["haproxy"]
    assert "fleet" in proxy["profiles"]
    assert any(volume.startswith("./haproxy.cfg:") for volume in proxy["volumes"])
    replicas = [name for name, service in services.items() if "fleet" in service.get("profiles", [])]
    assert {"gateway-1", "gateway-2", "gateway-3"} <= set(replicas)
    config = (REPO_ROOT / "docker" / "haproxy.cfg").read_text()
    assert all(f"GATEWAY_REPLICA_{n}" in config for n in (1, 2, 3))


# ---- gateway-wide actions ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kind", "via"), [("redis", "route"), ("cluster", "route"), ("redis", "passthrough")])
def test_abort_all_reaches_every_replica(
    paced: Service, tmp_path: Path, kind: str, via: str, request: pytest.FixtureRequest
) -> None:
    """A turn runs on each of three replicas; ``POST /v1/abort_all`` to one of them (or slime's end of a rollout,
    ``/abort_request {"abort_all": true}`` through its passthrough) ends all three (over the store's channel), each
    aborted-but-coherent: its tokens so far folded in, the session marked aborted, never resumed (the sessions
    resume the engine's aborts they did not ask for)."""
    url = request.getfixturevalue("redis_server" if kind == "redis" else "redis_cluster").url
    reason = "end of rollout " + uuid.uuid4().hex[:6]
    long_answer = {"stream": True, "sampling_params": {"max_new_tokens": 400}}  # 8 s
    with fleet(paced, url, tmp_path) as (_, replicas), ThreadPoolExecutor(3) as pool:
        deadline = time.monotonic() + 30
        while not all(httpx.get(f"{r.url}/health", timeout=5).json()["fleet_channel"] for r in replicas):
            assert time.monotonic() < deadline, "a replica never subscribed to the gateway-wide channel"
            time.sleep(0.05)
        sids = [create(r.url, resume=True) for r in replicas]

        def stream(replica: Replica, sid: str) -> bytes:
            with httpx.stream("POST", f"{replica.url}/v1/sessions/{sid}/generate", json=long_answer, timeout=60) as s:
                return b"".join(s.iter_raw())

        streams = [pool.submit(stream, r, sid) for r, sid in zip(replicas, sids, strict=True)]
        for replica, sid in zip(replicas, sids, strict=True):
            while not httpx.get(f"{replica.url}/v1/sessions/{sid}", timeout=10).json()["busy"]:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        if via == "route":
            answer = httpx.post(f"{replicas[0].url}/v1/abort_all", json={"reason": reason}, timeout=30)
            assert answer.status_code == 200, answer.text
            assert answer.json()["aborted"] == 1 and answer.json()["published"] is True
        else:
            answer = httpx.post(f"{replicas[0].url}/abort_request", json={"abort_all": True}, timeout=30)
            assert answer.status_code == 200, answer.text
        for replica, sid, received in zip(replicas, sids, streams, strict=True):
            assert b'"type":"turn"' in received.result(timeout=30)
            view = httpx.get(f"{replica.url}/v1/sessions/{sid}", timeout=10).json()
            assert view["status"] == "aborted" and view["last_error"], view  # (the engine's words for the abort)
            assert 0 < view["response_length"] < 400


def test_abort_all_on_one_gateway_aborts_its_turns(paced: Service) -> None:
    """The in-memory store: one replica, nothing to publish; its own turns end."""
    from conftest import run_gateway

    with run_gateway(paced.url) as gateway, ThreadPoolExecutor(1) as pool:
        sid = create(gateway.url)
        body = {"stream": True, "sampling_params": {"max_new_tokens": 400}}
        running = pool.submit(lambda: httpx.post(f"{gateway.url}/v1/sessions/{sid}/generate", json=body, timeout=60))
        deadline = time.monotonic() + 20
        while not httpx.get(f"{gateway.url}/v1/sessions/{sid}", timeout=10).json()["busy"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        answer = httpx.post(f"{gateway.url}/v1/abort_all", timeout=30).json()
        assert answer == {"aborted": 1, "published": False, "receivers": 0}
        assert running.result().status_code == 200
        assert httpx.get(f"{gateway.url}/v1/sessions/{sid}", timeout=10).json()["status"] == "aborted"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))
