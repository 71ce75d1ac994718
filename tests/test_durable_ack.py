"""A turn is acknowledged only once it is durable, and "nothing was written" is said only when nothing was.

Real processes: a redis-server (or a Redis Cluster) of each test's own that the test kills, pauses and starts
again, gateway processes on it, a simulator pacing its tokens so that a fault lands in the middle of a turn.

- A streamed turn whose store write fails sends nothing of the answer that commits it (the stop reason, the tool
  calls, ``message_stop``, ``response.completed``, the token stream's ``turn`` event): the stream ends with the
  API's error, and the session holds what it held before.
- On a Redis Cluster the session index (one key, on one master) is not part of a turn's commit: a turn whose index
  update fails is still answered as the success it is, and creates do not depend on that master.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from chat_checks import CALL_TEXT, WEATHER_TOOL, script
from conftest import Service, run_gateway, run_simulator
from fleet import AOF, RedisNode, Replica, redis_cluster, redis_node
from procs import free_port

from gateway.redis_store import Keys

PROMPT = list(range(10, 30))
WEATHER_ANTHROPIC = {
    "name": "get_weather",
    "description": WEATHER_TOOL["function"]["description"],
    "input_schema": WEATHER_TOOL["function"]["parameters"],
}
WEATHER_RESPONSES = {"type": "function", **WEATHER_TOOL["function"]}


@pytest.fixture(scope="module")
def paced_sim(tokenizer_dir: Path) -> Iterator[Service]:
    """A simulator speaking the tiny tokenizer whose tokens come 60 ms apart: a turn lasts a second or two, long
    enough to stop Redis between its first answer byte and its write."""
    with run_simulator("--tokenizer", str(tokenizer_dir), "--token-delay-ms", "60") as service:
        yield service


def store_env(url: str) -> dict[str, str]:
    return {"GATEWAY_STORE": url, "GATEWAY_REDIS_PREFIX": f"ack-{uuid.uuid4().hex[:6]}", "GATEWAY_REDIS_LEASE_S": "3"}


def create(gateway: Service, **body: Any) -> str:
    sid = f"ack-{uuid.uuid4().hex[:10]}"
    response = httpx.post(f"{gateway.url}/v1/sessions", json={"session_id": sid, **body}, timeout=30)
    assert response.status_code == 201, response.text
    return sid


# Each API's streamed request, and the bytes that would say the turn is done (none may come before the write).
STREAMS: dict[str, tuple[str, dict[str, Any], tuple[bytes, ...]]] = {
    "openai": (
        "chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Weather?"}],
            "stream": True,
            "tools": [WEATHER_TOOL],
        },
        (b'"finish_reason":"', b'"tool_calls"'),
    ),
    "anthropic": (
        "v1/messages",
        {
            "model": "tiny",
            "max_tokens": 256,
            "messages": [{"role": "user", "content": "Weather?"}],
            "stream": True,
            "tools": [WEATHER_ANTHROPIC],
        },
        (b"event: message_delta", b"event: message_stop", b'"stop_reason":"', b'"type":"tool_use"'),
    ),
    "responses": (
        "responses",
        {"model": "tiny", "input": "Weather?", "stream": True, "tools": [WEATHER_RESPONSES]},
        (b"response.completed", b"response.incomplete", b'"type":"function_call"'),
    ),
}
ERRORS = {"openai": b'data: {"error":', "anthropic": b"event: error", "responses": b"response.failed"}


def stream_killing_redis(url: str, body: dict[str, Any], kill: Any) -> bytes:
    """POST a streamed request; at its first answer byte after the head, ``kill()``; every byte received."""
    received = b""
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for piece in response.iter_raw():
            if not received:
                kill()
            received += piece
    return received


@pytest.fixture(scope="module")
def killable(
    paced_sim: Service, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RedisNode, Service]]:
    """A Redis (every write on disk before it answers) that a test kills and starts again, and a gateway with the
    chat routes on it: each test leaves Redis running."""
    with (
        redis_node(tmp_path_factory.mktemp("killable"), *AOF) as node,
        run_gateway(paced_sim.url, "--tokenizer", str(tokenizer_dir), env=store_env(node.url)) as gateway,
    ):
        yield node, gateway


@pytest.mark.parametrize("api", list(STREAMS))
def test_a_streamed_chat_turn_whose_write_fails_sends_no_stop(
    paced_sim: Service, killable: tuple[RedisNode, Service], api: str
) -> None:
    path, body, committing = STREAMS[api]
    node, gateway = killable
    sid = create(gateway)
    script(paced_sim, sid, CALL_TEXT)
    before = httpx.get(f"{gateway.url}/v1/sessions/{sid}", timeout=30).json()
    received = stream_killing_redis(f"{gateway.url}/v1/sessions/{sid}/{path}", body, node.kill)
    node.start()  # with every write it acknowledged (appendfsync always)
    assert ERRORS[api] in received, received[-2000:]
    for marker in committing:
        assert marker not in received, f"{marker!r} was sent for a turn that was not kept: {received[-2000:]!r}"
    after = httpx.get(f"{gateway.url}/v1/sessions/{sid}", timeout=30).json()
    assert (after["turns"], after["total_tokens"]) == (before["turns"], before["total_tokens"])


def test_a_streamed_token_turn_whose_write_fails_ends_with_an_error_event(killable: tuple[RedisNode, Service]) -> None:
    """The token-level stream: deltas, then ``error`` with no ``turn`` (nothing kept), never a ``turn`` event."""
    node, gateway = killable
    sid = create(gateway, prompt_ids=PROMPT)
    body = {"stream": True, "sampling_params": {"max_new_tokens": 16}}
    received = stream_killing_redis(f"{gateway.url}/v1/sessions/{sid}/generate", body, node.kill)
    node.start()
    assert b'"type":"error"' in received and b'"type":"turn"' not in received, received[-1000:]
    assert b'"store_unavailable"' in received and b'"turn":null' in received
    after = httpx.get(f"{gateway.url}/v1/sessions/{sid}", timeout=30).json()
    assert (after["turns"], after["total_tokens"]) == (0, len(PROMPT))


# ---- the session index on a Redis Cluster -------------------------------------------------------------------------
@contextmanager
def index_apart(tmp_path: Path) -> Iterator[tuple[Any, Keys, dict[str, str], Any, str]]:
    """A 3-master cluster without replicas, a gateway env on it, the master holding the session index, and a session
    id whose keys live on another master: (cluster, keys, env, index master, session id)."""
    env = store_env("")
    keys = Keys(env["GATEWAY_REDIS_PREFIX"])
    with redis_cluster(tmp_path / "cluster", replicas=0) as cluster:
        env["GATEWAY_STORE"] = cluster.url
        index_node = cluster.master_of(keys.index)
        yield cluster, keys, env, index_node, session_on_another_master(cluster, keys, index_node.port)


def session_on_another_master(cluster: Any, keys: Keys, avoid: int) -> str:
    """A session id whose keys live on another master than the node on port ``avoid``."""
    with cluster.client() as client:
        while True:
            sid = f"idx-{uuid.uuid4().hex[:10]}"
            if int(client.get_node_from_key(keys.session(sid)).port) != avoid:
                return sid


def test_on_a_cluster_a_turn_is_answered_as_written_when_the_index_master_is_down(
    simulator: Service, tmp_path: Path
) -> None:
    """The index (``PREFIX:index``, one key on one master) is down: a turn on a session of a healthy master is
    committed, so it is answered 200 (the index catches up later), not 503 "nothing was written"; a session can
    still be created there; once the index's master is back the new session is listed."""
    with (
        index_apart(tmp_path) as (cluster, keys, env, index_node, sid),
        run_gateway(simulator.url, env=env) as first,
        run_gateway(simulator.url, env=env) as second,
    ):
        created = httpx.post(f"{first.url}/v1/sessions", json={"session_id": sid, "prompt_ids": PROMPT}, timeout=30)
        assert created.status_code == 201, created.text
        index_node.kill()
        # The second replica's first write of the session (its index score goes with it).
        turn = httpx.post(f"{second.url}/v1/sessions/{sid}/generate", json={}, timeout=30)
        held = httpx.get(f"{second.url}/v1/sessions/{sid}", timeout=30).json()
        assert held["turns"] == 1  # it was committed ...
        assert turn.status_code == 200, turn.text  # ... so it is answered as such
        other = session_on_another_master(cluster, keys, index_node.port)
        made = httpx.post(f"{first.url}/v1/sessions", json={"session_id": other, "prompt_ids": PROMPT}, timeout=30)
        assert made.status_code == 201, made.text
        index_node.start()
        cluster.wait_until_ok()
        deadline = time.monotonic() + 60
        while True:  # repaired in the background
            try:
                listed = httpx.get(f"{first.url}/v1/sessions", timeout=30)
            except httpx.HTTPError:
                listed = None
            if listed is not None and listed.status_code == 200:
                ids = {s["session_id"] for s in listed.json()["sessions"]}
                if {sid, other} <= ids:
                    break
            assert time.monotonic() < deadline, "the index never listed the sessions made while it was down"
            time.sleep(0.2)


def test_index_master_down_deletes_still_delete(simulator: Service, tmp_path: Path) -> None:
    """A delete whose index update fails deleted the session: it answers so (not 503), and the index forgets it
    once its master is back."""
    with (
        index_apart(tmp_path) as (cluster, keys, env, index_node, sid),
        run_gateway(simulator.url, env=env) as gateway,
    ):
        created = httpx.post(f"{gateway.url}/v1/sessions", json={"session_id": sid, "prompt_ids": PROMPT})
        assert created.status_code == 201, created.text
        index_node.kill()
        deleted = httpx.delete(f"{gateway.url}/v1/sessions/{sid}", timeout=30)
        assert deleted.status_code == 204, deleted.text
        assert httpx.get(f"{gateway.url}/v1/sessions/{sid}", timeout=30).status_code == 404
        index_node.start()
        cluster.wait_until_ok()
        deadline = time.monotonic() + 60
        with redis.RedisCluster(host="127.0.0.1", port=index_node.port) as client:
            while client.zscore(keys.index, sid) is not None:
                assert time.monotonic() < deadline, "the index kept a deleted session"
                time.sleep(0.2)


# ---- a dead replica's hold, and when to come back --------------------------------------------------------------
def wait_until_busy(url: str, sid: str) -> None:
    deadline = time.monotonic() + 20
    while not httpx.get(f"{url}/v1/sessions/{sid}", timeout=10).json()["busy"]:
        assert time.monotonic() < deadline, "the turn never started"
        time.sleep(0.02)


def replicas_env(url: str, **extra: str) -> dict[str, str]:
    return store_env(url) | {"GATEWAY_REDIS_LEASE_S": "60"} | extra


@contextmanager
def two_replicas(simulator: Service, env_a: dict[str, str], env_b: dict[str, str]) -> Iterator[tuple[Replica, Replica]]:
    a = Replica("a", free_port(), ("--upstream-url", simulator.url), env_a)
    b = Replica("b", free_port(), ("--upstream-url", simulator.url), env_b)
    a.start()
    try:
        b.start()
        yield a, b
    finally:
        a.stop()
        b.stop()


def test_a_turn_on_a_held_session_is_told_when_to_come_back(simulator: Service, redis_server: Any) -> None:
    """A live replica's hold is never taken: the other replica answers 409 session_busy with ``Retry-After`` and
    ``x-should-retry: true`` (nothing ran), and the holder's turn is kept."""
    env = replicas_env(redis_server.url, GATEWAY_REDIS_HEARTBEAT_S="0.2")
    with two_replicas(simulator, env, env) as (a, b), ThreadPoolExecutor(1) as pool:
        sid = create(Service(a.url, a.port), prompt_ids=PROMPT)
        httpx.post(f"{simulator.url}/sim/faults", json={"mode": "delay", "delay_s": 2, "count": 1})
        running = pool.submit(httpx.post, f"{a.url}/v1/sessions/{sid}/generate", json={}, timeout=60)
        wait_until_busy(a.url, sid)
        refused = httpx.post(f"{b.url}/v1/sessions/{sid}/generate", json={}, timeout=30)
        assert refused.status_code == 409 and refused.json()["error"]["type"] == "session_busy", refused.text
        assert refused.headers["retry-after"] == "1" and refused.headers["x-should-retry"] == "true"
        assert running.result().status_code == 200
        assert httpx.get(f"{b.url}/v1/sessions/{sid}", timeout=10).json()["turns"] == 1


def retry_until_served(url: str, sid: str, deadline_s: float) -> tuple[httpx.Response, list[httpx.Response]]:
    """POST a turn as a harness does: a 409 is sent again after its ``Retry-After``; the answer and the 409s."""
    refusals = []
    deadline = time.monotonic() + deadline_s
    while True:
        answer = httpx.post(f"{url}/v1/sessions/{sid}/generate", json={}, timeout=30)
        if answer.status_code != 409 or time.monotonic() > deadline:
            return answer, refusals
        refusals.append(answer)
        time.sleep(float(answer.headers.get("retry-after", "1")))


def test_a_killed_replicas_hold_is_taken_over_long_before_its_lease_runs_out(
    simulator: Service, redis_server: Any
) -> None:
    """kill -9 mid-turn with a 60 s lease: its heartbeat stops, and within a few beats another replica takes the
    session over (the killed turn not in: the session is as before it)."""
    env = replicas_env(redis_server.url, GATEWAY_REDIS_HEARTBEAT_S="0.2")
    with two_replicas(simulator, env, env) as (doomed, survivor), ThreadPoolExecutor(1) as pool:
        sid = create(Service(doomed.url, doomed.port), prompt_ids=PROMPT)
        httpx.post(f"{survivor.url}/v1/sessions/{sid}/generate", json={}, timeout=30)
        before = httpx.get(f"{survivor.url}/v1/sessions/{sid}", timeout=10).json()
        httpx.post(f"{simulator.url}/sim/faults", json={"mode": "delay", "delay_s": 30, "count": 1})
        cut = pool.submit(httpx.post, f"{doomed.url}/v1/sessions/{sid}/generate", json={}, timeout=60)
        wait_until_busy(doomed.url, sid)
        doomed.kill()
        with pytest.raises(httpx.HTTPError):
            cut.result()
        answer, refusals = retry_until_served(survivor.url, sid, deadline_s=50)  # the lease: 60 s
        assert answer.status_code == 200, answer.text
        assert all(r.headers["retry-after"] == "1" for r in refusals)
        after = httpx.get(f"{survivor.url}/v1/sessions/{sid}", timeout=10).json()
        assert after["turns"] == before["turns"] + 1  # the killed turn never was, this one is
        httpx.delete(f"{simulator.url}/sim/faults")


def test_a_hold_without_a_heartbeat_is_never_taken_over(simulator: Service, redis_server: Any) -> None:
    """A replica that does not heartbeat (GATEWAY_REDIS_HEARTBEAT_S=0, or an older version in a rolling upgrade)
    holds its session until its lease runs out, even killed: nothing proves it stopped."""
    with_beat = replicas_env(redis_server.url, GATEWAY_REDIS_HEARTBEAT_S="0.2", GATEWAY_REDIS_LEASE_S="4")
    without = with_beat | {"GATEWAY_REDIS_HEARTBEAT_S": "0"}
    with two_replicas(simulator, without, with_beat) as (old, new), ThreadPoolExecutor(1) as pool:
        sid = create(Service(old.url, old.port), prompt_ids=PROMPT)
        httpx.post(f"{simulator.url}/sim/faults", json={"mode": "delay", "delay_s": 30, "count": 1})
        cut = pool.submit(httpx.post, f"{old.url}/v1/sessions/{sid}/generate", json={}, timeout=60)
        wait_until_busy(old.url, sid)
        old.kill()
        with pytest.raises(httpx.HTTPError):
            cut.result()
        time.sleep(1.0)  # several of the new replica's heartbeats: a heartbeating holder would be taken over by now
        assert httpx.post(f"{new.url}/v1/sessions/{sid}/generate", json={}, timeout=30).status_code == 409
        answer, _ = retry_until_served(new.url, sid, deadline_s=30)
        assert answer.status_code == 200  # once the lease ran out
        httpx.delete(f"{simulator.url}/sim/faults")


# ---- acknowledged once replicated ----------------------------------------------------------------------------------
def test_with_wait_replicas_an_acknowledged_turn_survives_its_masters_failover(
    simulator: Service, tmp_path: Path
) -> None:
    """GATEWAY_REDIS_WAIT_REPLICAS=1: a turn is answered once a replica of its master has it. The master is killed
    the moment the answer arrives and its replica promoted: the turn is there. With the replica paused, a turn is
    not acknowledged: 503 ``unconfirmed``, which says it may have been written (and tells SDKs not to resend
    blindly), never "nothing was written"."""
    env = store_env("") | {"GATEWAY_REDIS_WAIT_REPLICAS": "1", "GATEWAY_REDIS_WAIT_TIMEOUT_MS": "500"}
    keys = Keys(env["GATEWAY_REDIS_PREFIX"])
    with redis_cluster(tmp_path / "cluster") as cluster:
        env["GATEWAY_STORE"] = cluster.url
        with run_gateway(simulator.url, env=env) as gateway:
            sid = create(gateway, prompt_ids=PROMPT)
            master = cluster.master_of(keys.session(sid))
            replica = cluster.replica_of(master)
            replica.pause()
            try:
                refused = httpx.post(f"{gateway.url}/v1/sessions/{sid}/generate", json={}, timeout=30)
            finally:
                replica.resume()
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["reason"] == "unconfirmed" and refused.headers["x-should-retry"] == "false"
            assert "nothing was written" not in refused.text
            held = httpx.get(f"{gateway.url}/v1/sessions/{sid}", timeout=30).json()["total_tokens"]
            answer = httpx.post(f"{gateway.url}/v1/sessions/{sid}/generate", json={}, timeout=30)
            assert answer.status_code == 200, answer.text
            master.kill()  # at once: only what its replica has survives
            cluster.wait_for_promotion(replica)
            deadline = time.monotonic() + 30
            while (after := httpx.get(f"{gateway.url}/v1/sessions/{sid}", timeout=30)).status_code != 200:
                assert time.monotonic() < deadline, after.text
                time.sleep(0.2)
            assert after.json()["total_tokens"] == held + answer.json()["completion_tokens"]


# ---- a write whose answer was lost ---------------------------------------------------------------------------------
# The store's layer alone, on a real Redis: the network between them loses the write script's answer (it raises
# a timeout after the script ran, or before it reached Redis). The store must find out which from Redis.
@contextmanager
def losing_the_next_write(ran: bool) -> Iterator[None]:
    from redis.exceptions import TimeoutError as RedisTimeoutError

    from gateway import redis_store

    original = redis_store.Script._run
    state = {"armed": True}

    write = redis_store.Script(redis_store._WRITE)

    async def run(client: Any, command: str, script: str, keys: list[str], *rest: Any) -> Any:
        if state["armed"] and script in (write.sha, write.text):
            state["armed"] = False
            if ran:
                await original(client, command, script, keys, *rest)
            raise RedisTimeoutError("Timeout reading from socket (the answer was lost)")
        return await original(client, command, script, keys, *rest)

    redis_store.Script._run = staticmethod(run)  # type: ignore[method-assign]
    try:
        yield
    finally:
        redis_store.Script._run = staticmethod(original)  # type: ignore[method-assign]


@pytest.mark.parametrize("ran", [True, False], ids=["written", "not-written"])
async def test_a_write_whose_answer_was_lost_is_settled_from_redis(redis_server: Any, ran: bool) -> None:
    import numpy as np

    from gateway.errors import StoreUnavailable
    from gateway.redis_store import RedisSessionStore
    from gateway.sample import SessionSample

    store = RedisSessionStore(
        redis_server.url, prefix=f"lost-{uuid.uuid4().hex[:6]}", lease_s=30, instance_id="x", max_sessions=100
    )
    await store.start()
    try:
        await store.create(SessionSample.from_prompt(PROMPT), session_id="s")
        trajectory = await store.acquire("s")
        trajectory.sample.append_tool_tokens(np.array([7, 8, 9], np.int32))
        with losing_the_next_write(ran):
            if ran:  # it happened: the turn is kept and answered as such
                await store.release(trajectory)
            else:  # it did not: a 503 that says nothing was written (true), and the session as before
                with pytest.raises(StoreUnavailable) as caught:
                    await store.release(trajectory)
                assert caught.value.details["reason"] == "redis"
        prefix = store._keys.prefix
        fresh = RedisSessionStore(redis_server.url, prefix=prefix, lease_s=30, instance_id="y", max_sessions=9)
        await fresh.start()
        try:
            held = (await fresh.get("s")).sample.tokens.view().tolist()
        finally:
            await fresh.aclose()
        assert held == PROMPT + ([7, 8, 9] if ran else [])
    finally:
        await store.aclose()
