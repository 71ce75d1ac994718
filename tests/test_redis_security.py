"""The shared path, secured: the Redis store over TLS (``rediss://``) and as an ACL user of only the commands the store
needs (``gateway.redis_store.acl_rules``).

A real redis-server (Debian's, built with TLS) serving TLS only, with a test CA, server certificate and client
certificate made here; its default user switched off, so that the gateway can only be the ACL user. Two gateway
replicas then do everything the store does (create, unary and streamed turns, appends, big staged writes, reads from
another replica, a dead replica's hold taken over, the gateway-wide channel, the idle sweep, deletes), and Redis's
``ACL LOG`` must hold no refusal; the user cannot run anything else. A gateway that does not trust the server's
certificate gets no session.
"""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from conftest import Service, redis_binary, run_gateway
from fleet import Replica
from procs import free_port

from gateway.redis_store import acl_rules

PROMPT = list(range(10, 30))
PASSWORD = "acl-" + uuid.uuid4().hex


@dataclass(frozen=True)
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_certificates(directory: Path) -> Certificates:
    """A test CA, a server certificate for 127.0.0.1 and a client certificate, signed by it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def write_key(key: Any, path: Path) -> None:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("slime-gateway test CA"))
        .issuer_name(name("slime-gateway test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )

    def issue(common: str, usage: Any, san: list[Any]) -> tuple[Any, Any]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(common))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(ca_key, hashes.SHA256()), key

    server, server_key = issue(
        "127.0.0.1", ExtendedKeyUsageOID.SERVER_AUTH, [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    client, client_key = issue("slime-gateway", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    paths = Certificates(*(directory / f for f in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")))
    paths.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths.server_cert.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    write_key(server_key, paths.server_key)
    paths.client_cert.write_bytes(client.public_bytes(serialization.Encoding.PEM))
    write_key(client_key, paths.client_key)
    return paths


@dataclass
class TlsRedis:
    port: int
    certs: Certificates
    process: subprocess.Popen[bytes]

    def admin(self) -> redis.Redis:
        """The operator's connection (TLS, as the admin user)."""
        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            ssl=True,
            ssl_ca_certs=str(self.certs.ca),
            ssl_certfile=str(self.certs.client_cert),
            ssl_keyfile=str(self.certs.client_key),
            username="admin",
            password=PASSWORD,
        )

    def url(self, prefix_user: str, *, ca: bool = True) -> str:
        query = f"ssl_certfile={self.certs.client_cert}&ssl_keyfile={self.certs.client_key}"
        if ca:
            query += f"&ssl_ca_certs={self.certs.ca}"
        return f"rediss://{prefix_user}:{PASSWORD}@127.0.0.1:{self.port}/0?{query}"


@contextmanager
def tls_redis(directory: Path, prefixes: list[str]) -> Iterator[TlsRedis]:
    """redis-server on TLS only (client certificates required), the default user off, an ``admin`` user, and one
    user per key prefix (named after it) with exactly ``acl_rules(prefix)``."""
    certs = make_certificates(directory)
    port = free_port()
    command = [str(redis_binary("redis-server")), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1"]
    command += ["--tls-cert-file", str(certs.server_cert), "--tls-key-file", str(certs.server_key)]
    command += ["--tls-ca-cert-file", str(certs.ca), "--tls-auth-clients", "yes", "--save", "", "--appendonly", "no"]
    command += ["--user", "default", "off", "--user", "admin", "on", f">{PASSWORD}", "~*", "&*", "+@all"]
    for prefix in prefixes:
        command += ["--user", prefix, "on", f">{PASSWORD}", *acl_rules(prefix)]
    log = directory / "redis.log"
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    server = TlsRedis(port, certs, process)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with server.admin() as client:
                    client.ping()
                break
            except redis.RedisError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the TLS redis-server did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.1)
        yield server
    finally:
        process.terminate()
        process.wait(10)


def post(url: str, path: str, body: dict[str, Any] | None = None, status: int = 200) -> dict[str, Any]:
    answer = httpx.post(f"{url}{path}", json=body or {}, timeout=60)
    assert answer.status_code == status, answer.text
    return answer.json() if answer.content else {}


def test_tls_and_an_acl_user_of_only_the_stores_commands(simulator: Service, tmp_path: Path) -> None:
    main, swept = "sec-main", "sec-swept"
    with tls_redis(tmp_path, [main, swept]) as server, ExitStack() as stack, ThreadPoolExecutor(1) as pool:
        env = {
            "GATEWAY_STORE": server.url(main),
            "GATEWAY_REDIS_PREFIX": main,
            "GATEWAY_REDIS_LEASE_S": "60",
            "GATEWAY_REDIS_HEARTBEAT_S": "0.2",
            "GATEWAY_LOG_LEVEL": "warning",
        }
        a, b = (Replica(name, free_port(), ("--upstream-url", simulator.url), env) for name in ("a", "b"))
        for replica in (a, b):
            replica.start()
            stack.callback(replica.stop)
        deadline = time.monotonic() + 30
        while not all(httpx.get(f"{r.url}/health").json()["fleet_channel"] for r in (a, b)):  # SUBSCRIBE works
            assert time.monotonic() < deadline
            time.sleep(0.05)
        sid = f"sec-{uuid.uuid4().hex[:8]}"
        post(a.url, "/v1/sessions", {"session_id": sid, "prompt_ids": PROMPT}, status=201)
        post(a.url, f"/v1/sessions/{sid}/generate")
        with httpx.stream("POST", f"{a.url}/v1/sessions/{sid}/generate", json={"stream": True}, timeout=60) as s:
            assert b'"type":"turn"' in b"".join(s.iter_raw())
        post(b.url, f"/v1/sessions/{sid}/append", {"token_ids": list(range(40_000))})  # staged: SET + RENAME
        post(b.url, f"/v1/sessions/{sid}/generate")  # read whole by another replica
        assert httpx.get(f"{a.url}/v1/sessions", timeout=30).json()["sessions"][0]["session_id"] == sid
        assert httpx.get(f"{a.url}/v1/sessions/{sid}/sample", timeout=30).status_code == 200
        assert post(b.url, "/v1/abort_all")["published"] is True  # PUBLISH
        # A replica killed mid-turn: the other takes its hold over (its heartbeat key is gone).
        httpx.post(f"{simulator.url}/sim/faults", json={"mode": "delay", "delay_s": 20, "count": 1})
        cut = pool.submit(httpx.post, f"{a.url}/v1/sessions/{sid}/generate", json={}, timeout=60)
        while not httpx.get(f"{a.url}/v1/sessions/{sid}").json()["busy"]:  # (busy: a turn of this replica's)
            assert time.monotonic() < deadline + 60, "the turn never started"
            time.sleep(0.02)
        a.kill()
        with pytest.raises(httpx.HTTPError):
            cut.result()
        while (answer := httpx.post(f"{b.url}/v1/sessions/{sid}/generate", json={}, timeout=30)).status_code == 409:
            assert time.monotonic() < deadline + 60, "the dead replica's hold was never taken over"
            time.sleep(0.2)
        assert answer.status_code == 200, answer.text
        httpx.delete(f"{simulator.url}/sim/faults")
        assert httpx.delete(f"{b.url}/v1/sessions/{sid}", timeout=30).status_code == 204
        # The idle sweep, as another prefix's user.
        sweep_env = env | {
            "GATEWAY_STORE": server.url(swept),
            "GATEWAY_REDIS_PREFIX": swept,
            "GATEWAY_SESSION_IDLE_TTL_S": "1",
        }
        with run_gateway(simulator.url, env=sweep_env) as sweeper:
            old = f"sec-{uuid.uuid4().hex[:8]}"
            post(sweeper.url, "/v1/sessions", {"session_id": old, "prompt_ids": PROMPT}, status=201)
            while httpx.get(f"{sweeper.url}/v1/sessions/{old}", timeout=10).status_code != 404:
                assert time.monotonic() < deadline + 120, "the idle sweep never dropped the session"
                time.sleep(0.2)
        with server.admin() as admin:
            refusals = admin.acl_log()
        assert refusals == [], refusals
        with redis.Redis.from_url(server.url(main)) as user:
            with pytest.raises(redis.exceptions.NoPermissionError):
                user.flushall()
            with pytest.raises(redis.exceptions.NoPermissionError):
                user.get("another-prefix:s:{x}")
            with pytest.raises(redis.exceptions.NoPermissionError):
                user.keys("*")


def test_a_gateway_that_does_not_trust_the_servers_certificate_gets_no_session(
    simulator: Service, tmp_path: Path
) -> None:
    with tls_redis(tmp_path, ["sec-untrusted"]) as server:
        env = {"GATEWAY_STORE": server.url("sec-untrusted", ca=False), "GATEWAY_REDIS_PREFIX": "sec-untrusted"}
        with run_gateway(simulator.url, env=env) as gateway:
            refused = httpx.post(f"{gateway.url}/v1/sessions", json={"prompt_ids": PROMPT}, timeout=30)
            assert refused.status_code == 503 and refused.json()["error"]["type"] == "store_unavailable"
            assert "certificate" in refused.json()["error"]["message"].lower()


def test_on_a_cluster_the_acl_user_needs_only_the_slot_map_besides(simulator: Service, tmp_path: Path) -> None:
    """The same user on every node of a Redis Cluster, with ``acl_rules(prefix, cluster=True)``: turns, reads by
    another replica, listing, the channel and deletes run, and no node logs a refusal."""
    from fleet import redis_cluster

    prefix = "sec-cluster"
    user = ("--user", prefix, "on", f">{PASSWORD}", *acl_rules(prefix, cluster=True))
    with redis_cluster(tmp_path / "cluster", *user) as cluster:
        url = cluster.url.replace("://", f"://{prefix}:{PASSWORD}@")
        env = {"GATEWAY_STORE": url, "GATEWAY_REDIS_PREFIX": prefix, "GATEWAY_REDIS_WAIT_REPLICAS": "1"}
        with run_gateway(simulator.url, env=env) as a, run_gateway(simulator.url, env=env) as b:
            sids = [f"sec-{uuid.uuid4().hex[:8]}" for _ in range(6)]  # on every master, most likely
            for sid in sids:
                post(a.url, "/v1/sessions", {"session_id": sid, "prompt_ids": PROMPT}, status=201)
                post(b.url, f"/v1/sessions/{sid}/generate")
                post(a.url, f"/v1/sessions/{sid}/append", {"token_ids": [1, 2]})
            listed = {s["session_id"] for s in httpx.get(f"{b.url}/v1/sessions", timeout=30).json()["sessions"]}
            assert set(sids) <= listed
            assert post(a.url, "/v1/abort_all")["published"] is True
            for sid in sids:
                assert httpx.delete(f"{b.url}/v1/sessions/{sid}", timeout=30).status_code == 204
        for node in cluster.nodes:
            with node.client() as admin:
                assert admin.acl_log() == [], (node.port, admin.acl_log())
