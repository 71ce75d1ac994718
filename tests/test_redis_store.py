"""The Redis session store: sessions that survive restarts and that any gateway replica serves.

Real processes throughout: a real redis-server (unpacked by `make test` into .redis/) or a real 3-master Redis
Cluster (created with redis-cli, as an operator does), gateway processes with GATEWAY_STORE pointing at it, the
shared simulator. The session API's own tests also run against this store (``any_gateway`` in
tests/test_gateway_e2e.py); here: what only several processes can show. The replica, kill and restart tests run on
both kinds of Redis (``store``: ``redis`` and ``cluster``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis
from chat_checks import TOP_P, openai_client, view
from conftest import (
    SIM_LAYERS,
    SIM_TOPK,
    RedisClusterNodes,
    RedisServer,
    Service,
    run_gateway,
    run_redis_cluster,
    start_redis_process,
    stop_process,
)
from procs import free_port
from safetensors.numpy import load

from gateway.redis_store import Keys, _raw

PROMPT = list(range(10, 40))
LEASE_S = 1.5
STORES = ["redis", "cluster"]


def redis_env(url: str, prefix: str) -> dict[str, str]:
    return {"GATEWAY_STORE": url, "GATEWAY_REDIS_PREFIX": prefix, "GATEWAY_REDIS_LEASE_S": str(LEASE_S)}


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest) -> str:
    """The URL of a shared Redis: one server, or a Redis Cluster (``redis+cluster://`` a seed node)."""
    deployment = request.getfixturevalue("redis_server" if request.param == "redis" else "redis_cluster")
    return str(deployment.url)


def sync_client(url: str) -> Any:
    """A synchronous redis-py client for the test's own looks into Redis."""
    if "+cluster://" in url:
        return redis.RedisCluster.from_url(url.replace("+cluster", "", 1))
    return redis.Redis.from_url(url)


@contextmanager
def replicas(upstream: str, url: str, count: int = 2, **env: str) -> Iterator[list[Service]]:
    """``count`` gateway processes on one Redis store (a prefix of their own)."""
    settings = redis_env(url, f"t-{uuid.uuid4().hex[:8]}") | env
    with _nested([run_gateway(upstream, "--log-level", "warning", env=settings) for _ in range(count)]) as services:
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


def tokens(count: int) -> dict[str, Any]:
    """A model turn's body: exactly ``count`` tokens."""
    return {"sampling_params": {"max_new_tokens": count, "ignore_eos": True}}


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
    for clock in ("created_at", "updated_at"):  # the branch's times: when each session ran
        metadata.pop(clock, None)
    return {"arrays": load(response.content), "metadata": metadata}


def assert_same_sample(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["metadata"] == b["metadata"]
    assert sorted(a["arrays"]) == sorted(b["arrays"])
    for name, array in a["arrays"].items():
        np.testing.assert_array_equal(array, b["arrays"][name], err_msg=name)


def assert_replicas_agree(gateways: list[Service], sid: str) -> dict[str, Any]:
    """Every replica shows the same session, and each view agrees with its own sample's arrays."""
    samples = [sample(g, sid) for g in gateways]
    views = [view(g, sid) for g in gateways]
    for got in samples[1:]:
        assert_same_sample(samples[0], got)
    for got in views:
        assert got["total_tokens"] == len(samples[0]["arrays"]["tokens"])
        assert got["last_tokens"] == samples[0]["arrays"]["tokens"][-len(got["last_tokens"]) :].tolist()
        assert _comparable(got) == _comparable(views[0])
    return samples[0]


def _comparable(got: dict[str, Any]) -> dict[str, Any]:
    """A view less what is this replica's own (its buffers' slack, when it last touched the session)."""
    return {k: v for k, v in got.items() if k not in ("updated_at", "stored_bytes", "inspector")}


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


# ---- keys ----------------------------------------------------------------------------------------------------------
def test_no_session_id_reaches_another_ones_keys() -> None:
    keys = Keys("p")
    ids = ["victim", "victim:lease", "victim}:lease", "a{b}", "a%7Bb%7D", "a%b", "x:x:1:tokens", "v2", "v2:lease"]
    every = {i: {keys.session(i), Keys.lease(keys.session(i)), Keys.part(keys.session(i), "s", "tokens")} for i in ids}
    for one in ids:
        for other in ids:
            if one != other:
                assert not every[one] & every[other], (one, other)
    # One hash tag per session: the braces hold the escaped id, and nothing after them is the id's.
    assert keys.session("a{b}") == "p:s:{a%7Bb%7D}" and keys.session("a%7Bb%7D") == "p:s:{a%257Bb%257D}"
    with pytest.raises(ValueError, match="prefix"):
        Keys("a{b}")


def test_array_bytes_are_sent_without_a_copy_whatever_the_shape() -> None:
    routing = np.arange(3 * 4 * 2, dtype=np.uint8).reshape(3, 4, 2)
    assert bytes(_raw(routing[1:])) == routing[1:].tobytes()
    assert len(_raw(np.zeros((0, 4, 2), np.uint8))) == 0 and len(_raw(np.zeros(5, np.int32))) == 20


@pytest.mark.parametrize("kind", STORES)
def test_ids_that_look_like_keys_are_sessions_of_their_own(
    simulator: Service, kind: str, request: pytest.FixtureRequest
) -> None:
    """`victim:lease` was the lease of `victim` (503 WRONGTYPE, 409 on delete); `v2:lease` made `v2` a 409."""
    url = request.getfixturevalue("redis_server" if kind == "redis" else "redis_cluster").url
    tag = uuid.uuid4().hex[:6]
    victim, twin = f"victim-{tag}", f"v2-{tag}"
    with replicas(simulator.url, url, count=1) as (gateway,):
        create(gateway, victim)
        for sid in (f"{victim}:lease", f"{victim}:x", f"{victim}:s:{victim}"):
            create(gateway, sid)
            post(gateway, f"/v1/sessions/{sid}/append", {"token_ids": [1]})
        turn = post(gateway, f"/v1/sessions/{victim}/generate", tokens(4))
        assert httpx.delete(f"{gateway.url}/v1/sessions/{victim}:lease").status_code == 204
        assert view(gateway, victim)["turns"] == 1 and view(gateway, victim)["total_tokens"] == turn["total_tokens"]
        assert view(gateway, f"{victim}:x")["total_tokens"] == len(PROMPT) + 1
        assert httpx.delete(f"{gateway.url}/v1/sessions/{victim}").status_code == 204
        assert view(gateway, f"{victim}:x")["total_tokens"] == len(PROMPT) + 1  # untouched by its prefix's delete
        create(gateway, f"{twin}:lease")
        create(gateway, twin)
        post(gateway, f"/v1/sessions/{twin}/generate", tokens(4))
        client = sync_client(url)
        keys = [key for key in client.scan_iter(match=f"*{{{twin}}}*")]
        assert keys and all(key.decode().split("{")[1].startswith(f"{twin}}}") for key in keys)
        slots = {client.keyslot(key) if kind == "cluster" else 0 for key in keys}
        assert len(slots) == 1  # one session, one Redis Cluster slot
        client.close()


# ---- replicas ------------------------------------------------------------------------------------------------------
def test_turns_through_either_replica_equal_one_process(simulator: Service, gateway: Service, store: str) -> None:
    sid = f"rep-{uuid.uuid4().hex[:8]}"
    with replicas(simulator.url, store) as (a, b):
        multi_turn([a, b], sid)
        from_a, from_b = sample(a, sid), sample(b, sid)
        view_a = view(a, sid)
    multi_turn([gateway], sid)  # the same turns in one in-memory gateway: the simulator answers alike
    single = sample(gateway, sid)
    assert_same_sample(from_a, from_b)
    assert_same_sample(from_a, single)
    assert view_a["turns"] == 3 and view_a["status"] in ("completed", "truncated")


def test_a_sessions_resume_default_holds_on_every_replica(simulator: Service, redis_server: RedisServer) -> None:
    """Created with ``resume: true`` on one replica, its turns on another resubmit an answer the engine aborts."""
    sid = f"resume-{uuid.uuid4().hex[:8]}"
    with replicas(simulator.url, redis_server.url) as (a, b):
        create(a, sid, resume=True)
        assert httpx.post(f"{simulator.url}/sim/faults", json={"mode": "abort"}).status_code == 200
        turn = post(b, f"/v1/sessions/{sid}/generate", tokens(12))
        assert (turn["resumed"], turn["completion_tokens"], turn["status"]) == (1, 12, "truncated")
        plain = f"plain-{uuid.uuid4().hex[:8]}"
        create(a, plain)
        assert httpx.post(f"{simulator.url}/sim/faults", json={"mode": "abort"}).status_code == 200
        turn = post(b, f"/v1/sessions/{plain}/generate", tokens(12))
        assert (turn["resumed"], turn["completion_tokens"], turn["status"]) == (0, 6, "aborted")


def test_a_second_turn_from_another_replica_is_a_409(simulator: Service, store: str) -> None:
    sid = f"busy-{uuid.uuid4().hex[:8]}"
    with replicas(simulator.url, store) as (a, b), httpx.Client(timeout=30) as http:
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
    env = redis_env(redis_server.url, f"chat-{uuid.uuid4().hex[:8]}")
    args = ("--tokenizer", str(tokenizer_dir), "--log-level", "warning")
    with run_gateway(chat_sim.url, *args, env=env) as a, run_gateway(chat_sim.url, *args, env=env) as b:
        sid = f"chat-{uuid.uuid4().hex[:8]}"
        httpx.post(f"{a.url}/v1/sessions", json={"session_id": sid}).raise_for_status()
        answers = [{"text": "Hello."}, {"text": "Fine."}]
        httpx.post(f"{chat_sim.url}/sim/script", json={"rid_prefix": f"{sid}-", "answers": answers}).raise_for_status()
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        first = openai_client(a, sid)
        reply = first.chat.completions.create(model="tiny", messages=messages, max_tokens=16)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "ok?"}]
        second = openai_client(b, sid)
        reply = second.chat.completions.create(model="tiny", messages=messages, max_tokens=16)
        assert reply.choices[0].message.content == "Fine."
        got = view(b, sid)
        assert got["branch"] == 0  # the history B got extended the record A wrote: no fork
        assert [m["role"] for m in got["chat"]["messages"]] == ["user", "assistant", "user", "assistant"]
        # An edited history through A forks a branch there; B then serves both branches, as A does.
        answers = [{"text": "Other."}]
        httpx.post(f"{chat_sim.url}/sim/script", json={"rid_prefix": f"{sid}-", "answers": answers}).raise_for_status()
        first.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hey"}], max_tokens=16)
        groups = [httpx.post(f"{g.url}/v1/samples", json={"session_ids": [sid]}).content for g in (a, b)]
        arrays = [load(group) for group in groups]
        assert {name.split("/")[0] for name in arrays[1]} == {"0", "1"}
        for name, array in arrays[0].items():
            np.testing.assert_array_equal(array, arrays[1][name], err_msg=name)


def test_a_sessions_caps_and_its_close_hold_on_every_replica(
    redis_server: RedisServer, tokenizer_dir: Any, chat_sim: Service
) -> None:
    """A trainer's caps (created through A) cut and refuse turns through B; a close through B refuses turns through A,
    in each API's shape, and survives A reloading the session from Redis."""
    env = redis_env(redis_server.url, f"caps-{uuid.uuid4().hex[:8]}")
    args = ("--tokenizer", str(tokenizer_dir), "--log-level", "warning")
    with run_gateway(chat_sim.url, *args, env=env) as a, run_gateway(chat_sim.url, *args, env=env) as b:
        sid = f"caps-{uuid.uuid4().hex[:8]}"
        body = {
            "session_id": sid,
            "sampling_defaults": {"max_new_tokens": 3},
            "max_turns": 2,
            "max_context_tokens": 500,
        }
        httpx.post(f"{a.url}/v1/sessions", json=body).raise_for_status()
        answers = [{"text": "one two three four five six"}]
        httpx.post(f"{chat_sim.url}/sim/script", json={"rid_prefix": f"{sid}-", "answers": answers}).raise_for_status()
        chat = {"model": "tiny", "max_tokens": 30, "messages": [{"role": "user", "content": "count"}]}
        answer = httpx.post(f"{b.url}/v1/sessions/{sid}/chat/completions", json=chat, timeout=30).json()
        assert answer["usage"]["completion_tokens"] == 3 and answer["choices"][0]["finish_reason"] == "length"
        assert view(a, sid)["total_tokens"] == view(b, sid)["total_tokens"]  # A reads B's turn: the caps came along
        closed = httpx.post(f"{b.url}/v1/sessions/{sid}/close", json={"wait_timeout_s": 1}, timeout=30)
        assert closed.status_code == 200 and closed.json()["drained"] is True
        messages = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "more"}]}
        refused = httpx.post(f"{a.url}/v1/sessions/{sid}/v1/messages", json=messages, timeout=30)
        assert refused.status_code == 409 and refused.json()["error"]["gateway_type"] == "session_closed"
        with run_gateway(chat_sim.url, *args, env=env) as c:  # a replica that loads the session fresh
            again = httpx.post(f"{c.url}/v1/sessions/{sid}/chat/completions", json=chat, timeout=30)
            assert again.status_code == 409 and again.json()["error"]["code"] == "session_closed"
        assert httpx.delete(f"{a.url}/v1/sessions/{sid}").status_code == 204


# ---- a session is its incarnation, not its id ----------------------------------------------------------------------
def test_a_session_deleted_and_created_again_elsewhere_is_never_served_stale(simulator: Service, store: str) -> None:
    """A cached the first session; B deletes it and creates another under the same id: A must serve and extend
    the new one (it served the old tokens, and wrote its turn after B's history)."""
    sid = f"again-{uuid.uuid4().hex[:8]}"
    with replicas(simulator.url, store) as (a, b):
        create(a, sid, prompt_ids=[1, 2, 3], sampling_defaults={})
        post(a, f"/v1/sessions/{sid}/append", {"token_ids": [10]})
        assert view(a, sid)["last_tokens"][-4:] == [1, 2, 3, 10]
        assert httpx.delete(f"{b.url}/v1/sessions/{sid}").status_code == 204
        create(b, sid, prompt_ids=[7, 7, 7, 7], sampling_defaults={})
        post(b, f"/v1/sessions/{sid}/append", {"token_ids": [8]})
        got = view(a, sid)
        assert (got["prompt_length"], got["total_tokens"], got["last_tokens"][-5:]) == (4, 5, [7, 7, 7, 7, 8])
        post(a, f"/v1/sessions/{sid}/append", {"token_ids": [9]})
        post(a, f"/v1/sessions/{sid}/generate", tokens(5))
        held = assert_replicas_agree([a, b], sid)["arrays"]["tokens"]
        assert held[:6].tolist() == [7, 7, 7, 7, 8, 9] and len(held) == 11
        assert view(b, sid)["prompt_length"] == 4


def test_a_create_sent_again_after_a_delete_is_not_mistaken_for_the_first(simulator: Service, store: str) -> None:
    """With a write counter, the re-created session's second write had the number B's copy of the first one had."""
    sid = f"resent-{uuid.uuid4().hex[:8]}"
    with replicas(simulator.url, store) as (a, b):
        create(a, sid)
        post(b, f"/v1/sessions/{sid}/generate", tokens(12))
        assert view(b, sid)["total_tokens"] == len(PROMPT) + 12
        assert httpx.delete(f"{a.url}/v1/sessions/{sid}").status_code == 204
        create(a, sid)  # the same create, sent again
        post(a, f"/v1/sessions/{sid}/generate", tokens(5))
        assert view(b, sid)["total_tokens"] == len(PROMPT) + 5
        post(b, f"/v1/sessions/{sid}/append", {"token_ids": [3]})
        assert assert_replicas_agree([a, b], sid)["arrays"]["tokens"][-1] == 3
        assert view(a, sid)["total_tokens"] == len(PROMPT) + 6


def test_the_idle_sweep_of_another_replica_then_a_new_session_under_the_id(simulator: Service, store: str) -> None:
    """A sweeper replica (a short GATEWAY_SESSION_IDLE_TTL_S) deletes an idle session that A has cached; a third
    replica creates another one under its id; A serves that one."""
    sid = f"swept-{uuid.uuid4().hex[:8]}"
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    env = redis_env(store, prefix)
    client = sync_client(store)
    with run_gateway(simulator.url, env=env) as a, run_gateway(simulator.url, env=env) as c:
        create(a, sid, prompt_ids=[1, 2, 3], sampling_defaults={})
        post(a, f"/v1/sessions/{sid}/append", {"token_ids": [10]})
        assert view(a, sid)["total_tokens"] == 4
        with run_gateway(simulator.url, env=env | {"GATEWAY_SESSION_IDLE_TTL_S": "1"}):
            deadline = time.monotonic() + 15
            while client.exists(Keys(prefix).session(sid)):  # looked at in Redis: A must not notice by itself
                assert time.monotonic() < deadline, "the sweeper did not delete the idle session"
                time.sleep(0.1)
        create(c, sid, prompt_ids=[7, 7, 7, 7], sampling_defaults={})
        post(c, f"/v1/sessions/{sid}/append", {"token_ids": [8]})
        assert view(a, sid)["last_tokens"][-5:] == [7, 7, 7, 7, 8]
        post(a, f"/v1/sessions/{sid}/generate", tokens(3))
        assert assert_replicas_agree([a, c], sid)["arrays"]["tokens"][:5].tolist() == [7, 7, 7, 7, 8]
    client.close()


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


def test_kill_9_between_turns_loses_nothing(simulator: Service, store: str) -> None:
    env = redis_env(store, f"kill-{uuid.uuid4().hex[:8]}")
    sid = f"kill-{uuid.uuid4().hex[:8]}"
    with run_gateway(simulator.url, env=env) as first:
        multi_turn([first], sid)
        before = sample(first, sid)
        kill_hard(first)
    with run_gateway(simulator.url, env=env) as restarted:
        assert_same_sample(sample(restarted, sid), before)
        post(restarted, f"/v1/sessions/{sid}/append", {"token_ids": [1]})  # and it goes on
        assert view(restarted, sid)["total_tokens"] == len(before["arrays"]["tokens"]) + 1


def test_kill_9_mid_turn_leaves_the_session_as_before_and_free_after_the_lease(simulator: Service, store: str) -> None:
    lease_s = 4.0  # long enough to see the dead replica's hold, short enough to wait out
    env = redis_env(store, f"mid-{uuid.uuid4().hex[:8]}") | {"GATEWAY_REDIS_LEASE_S": str(lease_s)}
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


class Deployment:
    """A Redis of a test's own (one server, or a 3-master cluster) in ``directory``, stopped and started again on the
    same ports: with persistence in ``extra``, it comes back with its data."""

    def __init__(self, directory: Path, extra: tuple[str, ...]) -> None:
        self.directory = directory
        self.extra = extra
        self.port = free_port()
        self.process: Any = None
        self.nodes: RedisClusterNodes | None = None

    @property
    def url(self) -> str:
        return self.nodes.url if self.nodes is not None else f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        if self.nodes is not None:
            self.nodes.start()
            self.nodes.wait_until_ok()
        else:
            self.process = start_redis_process(self.port, "--dir", str(self.directory), *self.extra)

    @property
    def processes(self) -> list[Any]:
        return self.nodes.processes if self.nodes is not None else [self.process]

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.signal(sig)
        for process in self.processes:
            process.wait(10)
        if self.nodes is not None:
            self.nodes.processes.clear()  # start() makes new ones

    def signal(self, sig: int) -> None:
        for process in self.processes:
            process.send_signal(sig)

    def save(self) -> None:
        """A snapshot (``SAVE``) on every node, now."""
        for port in self.nodes.ports if self.nodes is not None else [self.port]:
            with redis.Redis(port=port) as client:
                client.save()


@contextmanager
def deployment(kind: str, directory: Path, *extra: str) -> Iterator[Deployment]:
    deployed = Deployment(directory, extra)
    if kind == "cluster":
        with run_redis_cluster(directory, *extra) as nodes:
            deployed.nodes = nodes
            yield deployed
        return
    deployed.start()
    try:
        yield deployed
    finally:
        if deployed.process is not None:
            stop_process(deployed.process)


AOF = ("--appendonly", "yes", "--appendfsync", "always")


@pytest.mark.parametrize("kind", STORES)
def test_redis_down_is_a_503_and_nothing_is_half_written(simulator: Service, tmp_path: Path, kind: str) -> None:
    sid = f"down-{uuid.uuid4().hex[:8]}"
    with (
        deployment(kind, tmp_path, *AOF) as redis_store,
        run_gateway(simulator.url, env=redis_env(redis_store.url, "down")) as gateway,
    ):
        create(gateway, sid)
        post(gateway, f"/v1/sessions/{sid}/generate")
        before = sample(gateway, sid)
        redis_store.stop()
        for path, body in ((f"/v1/sessions/{sid}/generate", {}), ("/v1/sessions", {"prompt_ids": [1]})):
            refused = httpx.post(f"{gateway.url}{path}", json=body, timeout=30)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["type"] == "store_unavailable"
        assert httpx.get(f"{gateway.url}/health").status_code == 200  # the gateway itself is fine
        redis_store.start()
        assert_same_sample(sample(gateway, sid), before)
        post(gateway, f"/v1/sessions/{sid}/generate")


@pytest.mark.parametrize("kind", STORES)
def test_after_a_redis_restart_no_request_fails(simulator: Service, tmp_path: Path, kind: str) -> None:
    """Every replica's pooled connections die with Redis: each is retried once on a new one, not a 503."""
    sids = [f"restart-{uuid.uuid4().hex[:8]}" for _ in range(8)]
    with deployment(kind, tmp_path, *AOF) as redis_store, replicas(simulator.url, redis_store.url) as gateways:

        def agent(sid: str, gateway: Service) -> None:
            post(gateway, f"/v1/sessions/{sid}/generate", tokens(4))
            post(gateway, f"/v1/sessions/{sid}/append", {"token_ids": [5]})
            sample(gateway, sid)

        for sid in sids:
            create(gateways[0], sid)
        with ThreadPoolExecutor(8) as pool:  # several connections pooled in each replica
            list(pool.map(agent, sids, gateways * 4))
        redis_store.stop()
        redis_store.start()
        with ThreadPoolExecutor(8) as pool:  # each on the other replica
            list(pool.map(agent, sids, gateways[::-1] * 4))
        for sid in sids:
            assert view(gateways[1], sid)["turns"] == 4
        assert_replicas_agree(gateways, sids[0])


@pytest.mark.parametrize("kind", STORES)
def test_redis_restarted_from_an_older_snapshot_replicas_agree_with_it(
    simulator: Service, tmp_path: Path, kind: str
) -> None:
    """Redis comes back with an older copy (its last snapshot): every replica serves that copy, not what it had
    cached (the replicas disagreed; summaries and arrays did too), and goes on from it."""
    sid = f"rollback-{uuid.uuid4().hex[:8]}"
    with deployment(kind, tmp_path) as redis_store, replicas(simulator.url, redis_store.url) as (a, b):
        create(a, sid)
        post(a, f"/v1/sessions/{sid}/generate", tokens(6))
        snapshot = sample(a, sid)
        redis_store.save()
        post(b, f"/v1/sessions/{sid}/append", {"token_ids": [4, 5]})
        post(a, f"/v1/sessions/{sid}/generate", tokens(6))
        assert view(b, sid)["total_tokens"] == len(PROMPT) + 14  # both replicas hold the newer copy
        redis_store.stop(signal.SIGKILL)  # no save on the way down
        redis_store.start()
        assert_same_sample(assert_replicas_agree([a, b], sid), snapshot)
        assert view(a, sid)["total_tokens"] == len(PROMPT) + 6
        post(b, f"/v1/sessions/{sid}/generate", tokens(3))
        assert view(a, sid)["total_tokens"] == len(PROMPT) + 9
        assert_replicas_agree([a, b], sid)


def test_a_redis_pause_does_not_lock_the_session(simulator: Service, tmp_path: Path) -> None:
    """Redis paused past the client's timeout: the request is a 503, and the lease command Redis runs when it
    resumes does nothing (it held the session for the lease time: 409 session_busy for every retry)."""
    sid = f"pause-{uuid.uuid4().hex[:8]}"
    with deployment("redis", tmp_path) as redis_store, replicas(simulator.url, redis_store.url, count=1) as (gw,):
        create(gw, sid)
        post(gw, f"/v1/sessions/{sid}/generate", tokens(4))
        with ThreadPoolExecutor(1) as pool:
            redis_store.signal(signal.SIGSTOP)
            try:
                paused = pool.submit(httpx.post, f"{gw.url}/v1/sessions/{sid}/generate", json={}, timeout=30)
                time.sleep(6.5)  # past the gateway's 5 s Redis timeout
            finally:
                redis_store.signal(signal.SIGCONT)
            refused = paused.result()
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "store_unavailable", refused.text
        post(gw, f"/v1/sessions/{sid}/generate", tokens(4))  # not a 409
        assert view(gw, sid)["turns"] == 2  # the paused turn is not in


# ---- what a write costs --------------------------------------------------------------------------------------------
def test_a_turn_writes_only_its_new_bytes_in_one_round_trip(simulator: Service, redis_server: RedisServer) -> None:
    """O(new bytes) per turn: what Redis receives for an append does not grow with the session; and an append is two
    commands (the lease taken as the session's stamp is read, then one script that writes and lets go)."""
    client = redis.Redis(port=redis_server.port)
    sid = f"bytes-{uuid.uuid4().hex[:8]}"
    # (no heartbeat: its SET every second is no command of the append's)
    quiet = {"GATEWAY_REDIS_LEASE_S": "60", "GATEWAY_REDIS_HEARTBEAT_S": "0"}
    with replicas(simulator.url, redis_server.url, count=1, **quiet) as (gateway,):
        create(gateway, sid, prompt_ids=list(range(20_000)))
        sent, commands = [], []
        for _ in range(3):
            before = client.info("stats")["total_net_input_bytes"]
            with monitored(redis_server.port) as seen:
                post(gateway, f"/v1/sessions/{sid}/append", {"token_ids": [1, 2, 3]})
            sent.append(client.info("stats")["total_net_input_bytes"] - before)
            commands.append(seen)
    session_bytes = 20_000 * 4
    assert max(sent) < session_bytes / 20, sent  # the summary and small fields, not the 80 kB of tokens
    assert commands == [["evalsha", "evalsha"]] * 3, commands
    # Idle sessions leave Redis by themselves too (twice GATEWAY_SESSION_IDLE_TTL_S, 3600 s by default).
    keys = [key for key in client.scan_iter(match=f"*:s:{{{sid}}}*") if not key.endswith(b":lease")]
    assert keys and all(0 < client.pttl(key) <= 2 * 3600 * 1000 for key in keys)


@contextmanager
def monitored(port: int) -> Iterator[list[str]]:
    """The names of the commands clients send Redis while the block runs (``MONITOR``; not those scripts run)."""
    seen: list[str] = []
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"MONITOR\r\n")
        assert sock.recv(5) == b"+OK\r\n"
        yield seen
        sock.sendall(b"PING\r\n")  # marks the end: everything before it was sent during the block
        received = b""
        while b'"PING"' not in received and b'"ping"' not in received:
            received += sock.recv(1 << 20)
    for client, command in re.findall(rb'^\+[0-9.]+ \[\d+ ([^\]]+)\] "([^"]+)"', received, flags=re.MULTILINE):
        if client != b"lua" and command.lower() != b"ping":
            seen.append(command.decode().lower())


@pytest.mark.parametrize("kind", STORES)
def test_big_writes_go_in_chunks_and_every_replica_reads_them_back(
    simulator: Service, kind: str, request: pytest.FixtureRequest
) -> None:
    """New bytes from STAGE_BYTES on are staged beside the write script and become a chunk of their own; smaller
    ones are appended to the last chunk. Whatever the mix, another replica (and a fresh one) reads the same arrays,
    and no staging key is left behind."""
    url = request.getfixturevalue("redis_server" if kind == "redis" else "redis_cluster").url
    sid = f"chunks-{uuid.uuid4().hex[:8]}"
    big = list(range(40_000))  # 160 kB of tokens: staged
    with replicas(simulator.url, url) as (a, b):
        create(a, sid, prompt_ids=big, sampling_defaults={})
        post(b, f"/v1/sessions/{sid}/append", {"token_ids": big[::-1]})
        post(a, f"/v1/sessions/{sid}/append", {"token_ids": [1, 2, 3]})
        post(b, f"/v1/sessions/{sid}/generate", tokens(8))
        post(a, f"/v1/sessions/{sid}/append", {"token_ids": big[:20_000]})
        post(b, f"/v1/sessions/{sid}/generate", tokens(8))
        held = assert_replicas_agree([a, b], sid)
        prefix = next(iter(sync_client(url).scan_iter(match=f"*:s:{{{sid}}}"))).decode()
    tokens_held = held["arrays"]["tokens"]
    assert len(tokens_held) == 40_000 * 2 + 3 + 8 + 20_000 + 8
    np.testing.assert_array_equal(tokens_held[40_000:80_000], big[::-1])
    client = sync_client(url)
    chunk_keys = list(client.scan_iter(match=f"{prefix}:x:*:tokens:*"))
    assert len(chunk_keys) == 3  # the prompt, the first big append (+ what followed), the second big append
    assert not list(client.scan_iter(match=f"{prefix}:stage:*"))
    with run_gateway(simulator.url, env=redis_env(url, prefix.split(":s:")[0])) as fresh:
        assert_same_sample(sample(fresh, sid), held)
    client.close()


def test_renewing_holds_never_fails_a_turn(simulator: Service, redis_server: RedisServer) -> None:
    """A hold renewed while its turn is written must not fail the write (with WATCH it did: a 503 ``lease_lost``).
    Renewals every 0.2 s and 8 sessions in flight, so many writes meet one."""
    env = redis_env(redis_server.url, f"renew-{uuid.uuid4().hex[:8]}") | {"GATEWAY_REDIS_LEASE_S": "0.6"}
    sids = [f"renew-{uuid.uuid4().hex[:8]}" for _ in range(8)]
    with run_gateway(simulator.url, "--log-level", "warning", env=env) as gateway:

        def agent(sid: str) -> None:
            create(gateway, sid)
            for _ in range(10):
                post(gateway, f"/v1/sessions/{sid}/generate", tokens(4))
                post(gateway, f"/v1/sessions/{sid}/append", {"token_ids": [3]})

        with ThreadPoolExecutor(len(sids)) as pool:
            for done in [pool.submit(agent, sid) for sid in sids]:
                done.result()
        assert all(view(gateway, sid)["turns"] == 20 for sid in sids)
