"""The Redis session store: sessions that survive restarts and that any gateway replica serves.

Real processes throughout: a real redis-server (unpacked by `make test` into .redis/), gateway processes with
GATEWAY_STORE pointing at it, the shared simulator. The session API's own tests also run against this store
(``any_gateway`` in tests/test_gateway_e2e.py); here: what only several processes can show.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import redis
from conftest import SIM_LAYERS, SIM_TOPK, RedisServer, Service, run_gateway, run_redis
from safetensors.numpy import load

TOP_P = {"custom_params": {"return_top_p_token_ids": True}}
PROMPT = list(range(10, 40))
LEASE_S = 1.5


def redis_env(server: RedisServer, prefix: str) -> dict[str, str]:
    return {"GATEWAY_STORE": server.url, "GATEWAY_REDIS_PREFIX": prefix, "GATEWAY_REDIS_LEASE_S": str(LEASE_S)}


@contextmanager
def replicas(upstream: str, server: RedisServer, count: int = 2) -> Iterator[list[Service]]:
    """``count`` gateway processes on one Redis store (a prefix of their own)."""
    env = redis_env(server, f"t-{uuid.uuid4().hex[:8]}")
    with _nested([run_gateway(upstream, "--log-level", "warning", env=env) for _ in range(count)]) as services:
        yield services


@contextmanager
def _nested(managers: list[AbstractContextManager[Service]]) -> Iterator[list[Service]]:
    if not managers:
        yield []
        return
    with managers[0] as first, _nested(managers[1:]) as rest:
        yield [first, *rest]


def create(gateway: Service, sid: str, **extra: Any) -> None:
    body = {"session_id": sid, "prompt_ids": PROMPT, "num_layers": SIM_LAYERS, "moe_router_topk": SIM_TOPK}
    response = httpx.post(f"{gateway.url}/v1/sessions", json=body | {"sampling_defaults": TOP_P} | extra)
    assert response.status_code == 201, response.text


def post(gateway: Service, path: str, body: dict[str, Any] | None = None, status: int = 200) -> dict[str, Any]:
    response = httpx.post(f"{gateway.url}{path}", json=body or {}, timeout=30)
    assert response.status_code == status, response.text
    return response.json()


def sample(gateway: Service, sid: str) -> dict[str, Any]:
    """A sample as arrays and metadata (safetensors metadata has no fixed key order: compare it parsed)."""
    response = httpx.get(f"{gateway.url}/v1/sessions/{sid}/sample")
    assert response.status_code == 200, response.text
    size = struct.unpack("<Q", response.content[:8])[0]
    metadata = json.loads(response.content[8 : 8 + size]).get("__metadata__", {})
    metadata.pop("cached_tokens", None)  # the simulator's prefix cache: depends on what ran before
    return {"arrays": load(response.content), "metadata": metadata}


def assert_same_sample(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["metadata"] == b["metadata"]
    assert sorted(a["arrays"]) == sorted(b["arrays"])
    for name, array in a["arrays"].items():
        np.testing.assert_array_equal(array, b["arrays"][name], err_msg=name)


def multi_turn(gateways: list[Service], sid: str) -> None:
    """Create, then turns and an append, each through the next gateway in turn (the last one streamed)."""
    create(gateways[0], sid)
    post(gateways[1 % len(gateways)], f"/v1/sessions/{sid}/generate", {"sampling_params": {"max_new_tokens": 12}})
    post(gateways[0], f"/v1/sessions/{sid}/append", {"token_ids": [7, 8, 9], "text": " <tool>"})
    stream = httpx.post(
        f"{gateways[1 % len(gateways)].url}/v1/sessions/{sid}/generate",
        json={"sampling_params": {"max_new_tokens": 12}, "stream": True},
        timeout=30,
    )
    assert stream.status_code == 200 and '"type":"turn"' in stream.text, stream.text


# ---- replicas ------------------------------------------------------------------------------------------------------
def test_turns_through_either_replica_equal_one_process(
    simulator: Service, gateway: Service, redis_server: RedisServer
) -> None:
    sid = f"rep-{uuid.uuid4().hex[:8]}"
    with replicas(simulator.url, redis_server) as (a, b):
        multi_turn([a, b], sid)
        from_a, from_b = sample(a, sid), sample(b, sid)
        view_a = httpx.get(f"{a.url}/v1/sessions/{sid}").json()
    multi_turn([gateway], sid)  # the same turns in one in-memory gateway: the simulator answers alike
    single = sample(gateway, sid)
    assert_same_sample(from_a, from_b)
    assert_same_sample(from_a, single)
    assert view_a["turns"] == 3 and view_a["status"] in ("completed", "truncated")


def test_a_second_turn_from_another_replica_is_a_409(simulator: Service, redis_server: RedisServer) -> None:
    sid = f"busy-{uuid.uuid4().hex[:8]}"
    with replicas(simulator.url, redis_server) as (a, b), httpx.Client(timeout=30) as http:
        create(a, sid)
        http.post(f"{simulator.url}/sim/faults", json={"mode": "delay", "delay_s": 2, "count": 1}).raise_for_status()
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(http.post, f"{a.url}/v1/sessions/{sid}/generate", json={})
            deadline = time.monotonic() + 10
            while not http.get(f"{a.url}/v1/sessions/{sid}").json()["busy"]:  # A holds it from here
                assert time.monotonic() < deadline
                time.sleep(0.02)
            refused = http.post(f"{b.url}/v1/sessions/{sid}/generate", json={})
            deleted = http.delete(f"{b.url}/v1/sessions/{sid}")
            abort_elsewhere = http.post(f"{b.url}/v1/sessions/{sid}/abort").json()
            assert running.result().status_code == 200
        assert refused.status_code == 409 and refused.json()["error"]["type"] == "session_busy"
        assert refused.json()["error"]["instance_id"] == http.get(f"{a.url}/health").json()["instance_id"]
        assert deleted.status_code == 409
        # Aborts go to the replica running the turn: another one says which.
        assert (
            abort_elsewhere["aborted"] is False
            and abort_elsewhere["instance_id"] == refused.json()["error"]["instance_id"]
        )
        assert http.post(f"{b.url}/v1/sessions/{sid}/generate", json={}).status_code == 200  # free again


def test_a_chat_session_moves_between_replicas(
    simulator: Service, redis_server: RedisServer, tokenizer_dir: Any, chat_sim: Service
) -> None:
    env = redis_env(redis_server, f"chat-{uuid.uuid4().hex[:8]}")
    args = ("--tokenizer", str(tokenizer_dir), "--log-level", "warning")
    with run_gateway(chat_sim.url, *args, env=env) as a, run_gateway(chat_sim.url, *args, env=env) as b:
        sid = f"chat-{uuid.uuid4().hex[:8]}"
        httpx.post(f"{a.url}/v1/sessions", json={"session_id": sid}).raise_for_status()
        answers = [{"text": "Hello."}, {"text": "Fine."}]
        httpx.post(f"{chat_sim.url}/sim/script", json={"rid_prefix": f"{sid}-", "answers": answers}).raise_for_status()
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        first = openai.OpenAI(base_url=f"{a.url}/v1/sessions/{sid}", api_key="-", max_retries=0)
        reply = first.chat.completions.create(model="tiny", messages=messages, max_tokens=16)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "ok?"}]
        second = openai.OpenAI(base_url=f"{b.url}/v1/sessions/{sid}", api_key="-", max_retries=0)
        reply = second.chat.completions.create(model="tiny", messages=messages, max_tokens=16)
        assert reply.choices[0].message.content == "Fine."
        view = httpx.get(f"{b.url}/v1/sessions/{sid}").json()
        assert view["branch"] == 0  # the history B got extended the record A wrote: no fork
        assert [m["role"] for m in view["chat"]["messages"]] == ["user", "assistant", "user", "assistant"]
        # An edited history through A forks a branch there; B then serves both branches, as A does.
        answers = [{"text": "Other."}]
        httpx.post(f"{chat_sim.url}/sim/script", json={"rid_prefix": f"{sid}-", "answers": answers}).raise_for_status()
        first.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hey"}], max_tokens=16)
        groups = [httpx.post(f"{g.url}/v1/samples", json={"session_ids": [sid]}).content for g in (a, b)]
        arrays = [load(group) for group in groups]
        assert {name.split("/")[0] for name in arrays[1]} == {"0", "1"}
        for name, array in arrays[0].items():
            np.testing.assert_array_equal(array, arrays[1][name], err_msg=name)


# ---- restarts ------------------------------------------------------------------------------------------------------
def kill_hard(gateway: Service) -> None:
    """``kill -9`` the gateway process listening on the service's port."""
    pid = next(int(p) for p in os.listdir("/proc") if p.isdigit() and _listens(int(p), gateway.port))
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _alive(pid):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _listens(pid: int, port: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            args = cmdline.read().split(b"\0")
    except OSError:
        return False
    return b"gateway" in args and b"--port" in args and args[args.index(b"--port") + 1] == str(port).encode()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[1].split()[0] != "Z"
    except OSError:
        return False


def test_kill_9_between_turns_loses_nothing(simulator: Service, redis_server: RedisServer) -> None:
    env = redis_env(redis_server, f"kill-{uuid.uuid4().hex[:8]}")
    sid = f"kill-{uuid.uuid4().hex[:8]}"
    with run_gateway(simulator.url, env=env) as first:
        multi_turn([first], sid)
        before = sample(first, sid)
        kill_hard(first)
    with run_gateway(simulator.url, env=env) as restarted:
        assert_same_sample(sample(restarted, sid), before)
        post(restarted, f"/v1/sessions/{sid}/append", {"token_ids": [1]})  # and it goes on
        assert (
            httpx.get(f"{restarted.url}/v1/sessions/{sid}").json()["total_tokens"]
            == len(before["arrays"]["tokens"]) + 1
        )


def test_kill_9_mid_turn_leaves_the_session_as_before_and_free_after_the_lease(
    simulator: Service, redis_server: RedisServer
) -> None:
    lease_s = 4.0  # long enough to see the dead replica's hold, short enough to wait out
    env = redis_env(redis_server, f"mid-{uuid.uuid4().hex[:8]}") | {"GATEWAY_REDIS_LEASE_S": str(lease_s)}
    sid = f"mid-{uuid.uuid4().hex[:8]}"
    with run_gateway(simulator.url, env=env) as survivor, httpx.Client(timeout=30) as http:
        with run_gateway(simulator.url, env=env) as doomed, ThreadPoolExecutor(1) as pool:
            create(doomed, sid)
            post(doomed, f"/v1/sessions/{sid}/generate")
            before = sample(doomed, sid)
            http.post(f"{simulator.url}/sim/faults", json={"mode": "delay", "delay_s": 8, "count": 1})
            turn = pool.submit(http.post, f"{doomed.url}/v1/sessions/{sid}/generate", json={})
            deadline = time.monotonic() + 10
            while not http.get(f"{doomed.url}/v1/sessions/{sid}").json()["busy"]:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            kill_hard(doomed)  # mid-turn: it holds the session, and its fold never happens
            killed_at = time.monotonic()
            with pytest.raises(httpx.HTTPError):
                turn.result()
            # Held until the dead replica's lease runs out ...
            assert http.post(f"{survivor.url}/v1/sessions/{sid}/generate", json={}).status_code == 409
        time.sleep(max(0.0, killed_at + lease_s + 0.5 - time.monotonic()))
        # ... then free, and the killed turn is not in.
        assert_same_sample(sample(survivor, sid), before)
        post(survivor, f"/v1/sessions/{sid}/generate")


def test_redis_down_is_a_503_and_nothing_is_half_written(simulator: Service, tmp_path: Any) -> None:
    persisted = ("--appendonly", "yes", "--dir", str(tmp_path))  # so that the restarted server has the data
    sid = f"down-{uuid.uuid4().hex[:8]}"
    with run_redis(*persisted) as server:
        port = server.port
        env = redis_env(server, "down")
        with run_gateway(simulator.url, env=env) as gateway:
            create(gateway, sid)
            post(gateway, f"/v1/sessions/{sid}/generate")
            before = sample(gateway, sid)
            server.process.terminate()
            server.process.wait(10)
            for path, body in ((f"/v1/sessions/{sid}/generate", {}), ("/v1/sessions", {"prompt_ids": [1]})):
                refused = httpx.post(f"{gateway.url}{path}", json=body, timeout=30)
                assert refused.status_code == 503, refused.text
                assert refused.json()["error"]["type"] == "store_unavailable"
            assert httpx.get(f"{gateway.url}/health").status_code == 200  # the gateway itself is fine
            with run_redis(*persisted, port=port):
                assert_same_sample(sample(gateway, sid), before)
                post(gateway, f"/v1/sessions/{sid}/generate")


def test_a_turn_writes_only_its_new_bytes(simulator: Service, redis_server: RedisServer) -> None:
    """O(new bytes) per turn: what Redis receives for an append does not grow with the session."""
    client = redis.Redis(port=redis_server.port)
    sid = f"bytes-{uuid.uuid4().hex[:8]}"
    with replicas(simulator.url, redis_server, count=1) as (gateway,):
        create(gateway, sid, prompt_ids=list(range(20_000)))
        sent = []
        for _ in range(3):
            before = client.info("stats")["total_net_input_bytes"]
            post(gateway, f"/v1/sessions/{sid}/append", {"token_ids": [1, 2, 3]})
            sent.append(client.info("stats")["total_net_input_bytes"] - before)
    session_bytes = 20_000 * 4
    assert max(sent) < session_bytes / 20, sent  # the summary and small fields, not the 80 kB of tokens
    # Idle sessions leave Redis by themselves too (twice GATEWAY_SESSION_IDLE_TTL_S, 3600 s by default).
    keys = [key for key in client.scan_iter(match=f"*:s:{sid}*") if not key.endswith(b":lease")]
    assert keys and all(0 < client.pttl(key) <= 2 * 3600 * 1000 for key in keys)


def test_renewing_holds_never_fails_a_turn(simulator: Service, redis_server: RedisServer) -> None:
    """A hold renewed while its turn's transaction runs is a change to the watched key: the write is tried again
    rather than refused (it was a 503 ``lease_lost``). Renewals every 0.1 s and 8 sessions in flight, so many
    writes meet one."""
    env = redis_env(redis_server, f"renew-{uuid.uuid4().hex[:8]}") | {"GATEWAY_REDIS_LEASE_S": "0.3"}
    sids = [f"renew-{uuid.uuid4().hex[:8]}" for _ in range(8)]
    with run_gateway(simulator.url, "--log-level", "warning", env=env) as gateway:

        def agent(sid: str) -> None:
            create(gateway, sid)
            for _ in range(10):
                post(gateway, f"/v1/sessions/{sid}/generate", {"sampling_params": {"max_new_tokens": 4}})
                post(gateway, f"/v1/sessions/{sid}/append", {"token_ids": [3]})

        with ThreadPoolExecutor(len(sids)) as pool:
            for done in [pool.submit(agent, sid) for sid in sids]:
                done.result()
        assert all(httpx.get(f"{gateway.url}/v1/sessions/{sid}").json()["turns"] == 20 for sid in sids)
