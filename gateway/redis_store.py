"""The Redis session store (``GATEWAY_STORE=redis://host:port/db``): sessions that survive restarts and that any
gateway replica serves.

Each replica keeps the sessions it touches in memory, as the in-memory store does (the fold, the views and the
sample encodes run on those arrays unchanged), and Redis holds the truth:

- **Appends cost the new bytes.** Every array of a sample is one Redis string; a turn ``APPEND``s the items it added
  (``GrowableArray.generation`` says whether earlier items changed, as when an upstream resends all routing rows:
  then the string is rewritten). The turn log is a list (``RPUSH``), the response text a string (``APPEND``), the
  small fields (status, counters, versions, metadata, the chat record) a hash.
- **All or nothing.** What one turn or append changed is written in one ``MULTI``/``EXEC`` transaction when the
  session is released. A replica killed before it leaves Redis as before the turn; a write that fails (Redis down)
  is a 503 ``store_unavailable``, and the local copy is dropped so the next request reads Redis again.
- **One turn at a time, across replicas.** A turn holds a lease (``SET key NX PX``), renewed while it runs, so a
  second turn from any replica is a 409 and a replica that dies mid-turn frees the session when the lease runs out.
  The transaction is guarded by the lease (``WATCH``): a replica that lost it cannot write.
- **A version per session**, bumped by each write: a replica whose copy is older (another replica ran a turn)
  reloads the session before using it; otherwise it uses its copy without reading the arrays.

Aborts go to the replica running the turn (``POST /abort`` elsewhere answers which instance holds it).
``GATEWAY_MAX_STORED_BYTES`` bounds the bytes a replica keeps in memory: past it, the least recently used idle
sessions are dropped from memory (they stay in Redis).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError, WatchError

from gateway.buffers import GrowableArray
from gateway.chat.conversation import ChatRecord
from gateway.errors import SessionBusy, SessionExists, SessionNotFound, StoreUnavailable
from gateway.sample import MoEShape, SessionSample, Status, TurnRecord
from gateway.store import Session, SessionStore

log = logging.getLogger("gateway.redis_store")

# The sample's arrays: attribute -> dtype (None: stored with the sample, routing's narrowest unsigned type).
ARRAYS: dict[str, type | None] = {
    "tokens": np.int32,
    "loss_mask": np.uint8,
    "log_probs": np.float32,
    "weight_version_ids": np.int32,
    "top_p_ids": np.int32,
    "top_p_offsets": np.int32,
    "routed_experts": None,
}
# Deletes the lease, or extends it, only while it is ours (a lease that ran out may be another replica's now).
_UNLOCK = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"
_RENEW = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end"
)
SOCKET_TIMEOUT_S = 5.0
WRITE_ATTEMPTS = 3


class RedisSessionStore(SessionStore):
    def __init__(
        self,
        url: str,
        *,
        prefix: str,
        lease_s: float,
        instance_id: str,
        max_sessions: int,
        idle_ttl_s: float = 0.0,
        max_session_tokens: int | None = None,
        max_stored_bytes: int | None = None,
    ) -> None:
        super().__init__(max_sessions, max_session_tokens=max_session_tokens, max_stored_bytes=None)
        self._url = url
        self._prefix = prefix
        self._lease_ms = int(lease_s * 1000)
        self._instance = instance_id
        self._cache_bytes = max_stored_bytes
        # Redis drops a session's keys by itself once it is idle this long (0: never), even with no gateway left to
        # sweep: twice the sweep's TTL, so the sweep (which also keeps the index) normally comes first.
        self._key_ttl_ms = int(2 * idle_ttl_s * 1000)
        self._ttl_refreshed: dict[str, float] = {}  # session id -> when this replica last pushed all its TTLs
        self._redis: aioredis.Redis | None = None
        self._leases: dict[str, str] = {}  # session id -> the lease value this replica holds
        self._versions: dict[str, int] = {}  # session id -> the version of the local copy
        self._count = 0
        self._renewer: asyncio.Task[None] | None = None

    # ---- life ------------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._redis = aioredis.from_url(
            self._url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=SOCKET_TIMEOUT_S
        )
        self._unlock_script = self._redis.register_script(_UNLOCK)
        self._renew_script = self._redis.register_script(_RENEW)
        try:
            await self._refresh_count()
            log.info("session store: Redis %s (prefix %r), %d sessions", self._safe_url, self._prefix, self._count)
        except StoreUnavailable as exc:  # serve anyway: requests get 503s until Redis is back
            log.error("session store: Redis %s unreachable at start: %s", self._safe_url, exc.message)
        self._renewer = asyncio.create_task(self._renew_leases(), name="redis-leases")

    async def aclose(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
        for session_id, value in list(self._leases.items()):
            with contextlib.suppress(RedisError, OSError):
                await self._unlock_script(keys=[self._lease_key(session_id)], args=[value])
        if self._redis is not None:
            await self._redis.aclose()

    @property
    def _safe_url(self) -> str:
        return self._url.split("@")[-1]  # never a password from the URL in a log

    @property
    def count(self) -> int:
        return self._count

    # ---- keys ------------------------------------------------------------------------------------------------
    def _key(self, session_id: str) -> str:
        return f"{self._prefix}:s:{session_id}"

    def _lease_key(self, session_id: str) -> str:
        return f"{self._key(session_id)}:lease"

    def _sample_key(self, session_id: str, sample_id: str, part: str) -> str:
        return f"{self._key(session_id)}:x:{sample_id}:{part}"

    def _session_keys(self, session_id: str, sample_ids: list[str]) -> list[str]:
        parts = (*ARRAYS, "meta", "turns", "text")
        return [self._key(session_id)] + [self._sample_key(session_id, x, part) for x in sample_ids for part in parts]

    @property
    def _index(self) -> str:
        return f"{self._prefix}:index"

    @property
    def redis(self) -> aioredis.Redis:
        if self._redis is None:
            raise StoreUnavailable("the Redis session store is not started")
        return self._redis

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except WatchError:
            raise StoreUnavailable(
                f"{what}: the session's hold ran out before its write", reason="lease_lost"
            ) from None
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"{what}: the Redis session store failed: {exc}", reason="redis") from exc

    # ---- the store API ---------------------------------------------------------------------------------------
    async def create(
        self,
        sample: SessionSample,
        *,
        session_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        sampling_defaults: dict[str, Any] | None = None,
    ) -> Session:
        session = self._new_session(sample, session_id, metadata, sampling_defaults)
        sid = session.session_id
        with self._errors("create"):
            self._check_session_count(await self.redis.zcard(self._index))
            value = await self._lock(sid)
            if value is None or await self.redis.exists(self._key(sid)):
                if value is not None:
                    await self._unlock_script(keys=[self._lease_key(sid)], args=[value])
                raise SessionExists(f"session {sid!r} already exists", session_id=sid)
            try:
                await self._write(session, value)  # lets the hold go in the same transaction
            except BaseException:
                with contextlib.suppress(RedisError, OSError):
                    await self._unlock_script(keys=[self._lease_key(sid)], args=[value])
                raise
        self._register(session)
        self._count += 1
        return session

    async def get(self, session_id: str) -> Session:
        local = self._sessions.get(session_id)
        if local is not None and local.busy:  # a turn runs here: this copy is the newest there is
            return local
        with self._errors("read"):
            version = await self.redis.hget(self._key(session_id), "version")
        return await self._fresh(session_id, version)

    async def _fresh(self, session_id: str, version: bytes | None) -> Session:
        """The session at ``version`` (Redis's now): the local copy when it is that one, else loaded."""
        local = self._sessions.get(session_id)
        if version is None:
            self._forget(session_id)
            raise SessionNotFound(f"no session {session_id!r}", session_id=session_id)
        if local is not None and self._versions.get(session_id) == int(version):
            return local
        return await self._load(session_id)

    async def acquire(self, session_id: str) -> Session:
        value = f"{self._instance}:{secrets.token_hex(8)}"
        with self._errors("hold"):
            # One round trip: take the hold, and read the version the local copy must have.
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.set(self._lease_key(session_id), value, nx=True, px=self._lease_ms)
                pipe.hget(self._key(session_id), "version")
                held, version = await pipe.execute()
            if not held:
                if version is None:
                    raise SessionNotFound(f"no session {session_id!r}", session_id=session_id)
                owner = (await self.redis.get(self._lease_key(session_id)) or b"?").decode().split(":")[0]
                raise SessionBusy(
                    f"session {session_id!r} already has a turn running (on gateway instance {owner})",
                    session_id=session_id,
                    instance_id=owner,
                )
        try:
            session = await self._fresh(session_id, version)
        except BaseException:
            with contextlib.suppress(RedisError, OSError):
                await self._unlock_script(keys=[self._lease_key(session_id)], args=[value])
            raise
        self._leases[session_id] = value
        session.busy = True
        self._active += 1
        return session

    async def release(self, session: Session) -> None:
        sid = session.session_id
        value = self._leases.pop(sid, None)
        try:
            if value is not None:
                with self._errors("write"):
                    await self._write(session, value)  # lets the hold go in the same transaction
        except BaseException:
            self._unhold(session)
            self._forget(sid)  # Redis holds the truth: the next request reads it
            if value is not None:
                with contextlib.suppress(RedisError, OSError):
                    await self._unlock_script(keys=[self._lease_key(sid)], args=[value])
            raise
        self._unhold(session)
        self._trim_cache()

    async def delete(self, session_id: str) -> None:
        with self._errors("delete"):
            value = await self._lock(session_id)
            if value is None:
                if not await self.redis.exists(self._key(session_id)):
                    raise SessionNotFound(f"no session {session_id!r}", session_id=session_id)
                raise SessionBusy(f"session {session_id!r} has a turn running; abort or wait for it first")
            try:
                samples = await self.redis.hget(self._key(session_id), "samples")
                if samples is None:
                    raise SessionNotFound(f"no session {session_id!r}", session_id=session_id)
                keys = self._session_keys(session_id, orjson.loads(samples))
                async with self.redis.pipeline(transaction=True) as pipe:
                    pipe.delete(*keys)
                    pipe.zrem(self._index, session_id)
                    await pipe.execute()
            finally:
                await self._unlock_script(keys=[self._lease_key(session_id)], args=[value])
        self._forget(session_id)
        self._count = max(0, self._count - 1)

    async def list_sessions(self) -> list[dict[str, Any]]:
        with self._errors("list"):
            ids = [sid.decode() for sid in await self.redis.zrange(self._index, 0, -1)]
            async with self.redis.pipeline(transaction=False) as pipe:
                for sid in ids:
                    pipe.hget(self._key(sid), "summary")
                    pipe.exists(self._lease_key(sid))
                answers = await pipe.execute()
        self._count = len(ids)
        summaries = []
        for summary, busy in zip(answers[::2], answers[1::2], strict=True):
            if summary is not None:
                summaries.append(orjson.loads(summary) | {"busy": bool(busy)})
        return summaries

    async def holder(self, session_id: str) -> str | None:
        with self._errors("read"):
            value = await self.redis.get(self._lease_key(session_id))
        if value is None or session_id in self._leases:
            return None
        return value.decode().split(":")[0]

    async def expire_idle(self, ttl_s: float, now: float | None = None) -> list[str]:
        cutoff = (time.time() if now is None else now) - ttl_s
        with self._errors("expire"):
            idle = [sid.decode() for sid in await self.redis.zrangebyscore(self._index, "-inf", cutoff)]
        expired = []
        for session_id in idle:
            with contextlib.suppress(SessionBusy, SessionNotFound):
                await self.delete(session_id)
                expired.append(session_id)
        return expired

    def _check_store_room(self, new_bytes: int) -> None:
        """The sessions are in Redis: a replica's memory holds only a cache of them (``_trim_cache``)."""

    # ---- leases ----------------------------------------------------------------------------------------------
    async def _lock(self, session_id: str) -> str | None:
        value = f"{self._instance}:{secrets.token_hex(8)}"
        ok = await self.redis.set(self._lease_key(session_id), value, nx=True, px=self._lease_ms)
        return value if ok else None

    async def _renew_leases(self) -> None:
        while True:
            await asyncio.sleep(self._lease_ms / 3000)
            try:
                for session_id, value in list(self._leases.items()):
                    if self._leases.get(session_id) != value:  # released since the list was taken: being written
                        continue
                    if not await self._renew_script(keys=[self._lease_key(session_id)], args=[value, self._lease_ms]):
                        log.warning("session %s: its hold ran out before it was renewed", session_id)
                await self._refresh_count()
            except (RedisError, OSError, StoreUnavailable) as exc:
                log.warning("session store: renewing holds failed: %s", exc)

    async def _refresh_count(self) -> None:
        with self._errors("count"):
            self._count = await self.redis.zcard(self._index)

    # ---- writing: only what changed, in one transaction ------------------------------------------------------
    async def _write(self, session: Session, lease_value: str) -> None:
        """Write what changed, and let the hold go, in one transaction guarded by the hold (``WATCH``). The renewal
        of a hold (``PEXPIRE``) also counts as a change to it, so a transaction it interrupted is tried again while
        the hold is still this replica's."""
        session.touch()
        for attempt in range(WRITE_ATTEMPTS):
            try:
                await self._try_write(session, lease_value)
                return
            except WatchError:
                if attempt == WRITE_ATTEMPTS - 1:
                    raise

    async def _try_write(self, session: Session, lease_value: str) -> None:
        sid = session.session_id
        async with self.redis.pipeline(transaction=True) as pipe:
            lease = self._lease_key(sid)
            await pipe.watch(lease)
            if (await pipe.get(lease) or b"").decode() != lease_value:
                raise StoreUnavailable(f"session {sid!r}: the hold on it ran out before its write", reason="lease_lost")
            pipe.multi()
            created: list[str] = []
            pending = [self._queue_sample(pipe, sid, sample, created) for sample in session.samples]
            key = self._key(sid)
            pipe.hset(
                key,
                mapping={
                    "samples": orjson.dumps([p["id"] for p in pending]),
                    "metadata": orjson.dumps(session.metadata),
                    "sampling_defaults": orjson.dumps(session.sampling_defaults),
                    "created_at": repr(session.created_at),
                    "updated_at": repr(session.updated_at),
                    "chat": b"" if session.chat is None else orjson.dumps(session.chat.to_json()),
                    "summary": orjson.dumps(session.summary() | {"busy": False}),
                },
            )
            version_at = len(pipe.command_stack)  # where the new version is among the results
            pipe.hincrby(key, "version", 1)
            pipe.zadd(self._index, {sid: session.updated_at})
            # Each key's TTL: set when it is created, pushed forward for the whole session now and then (an APPEND
            # keeps a key's TTL; a PEXPIRE of every key on every turn cost more than the turn's own writes).
            refresh = (
                self._key_ttl_ms and time.monotonic() - self._ttl_refreshed.get(sid, 0.0) > self._key_ttl_ms / 10e3
            )
            if self._key_ttl_ms:
                for name in self._session_keys(sid, [p["id"] for p in pending]) if refresh else [key, *created]:
                    pipe.pexpire(name, self._key_ttl_ms)
            pipe.delete(lease)
            results = await pipe.execute()
        for sample, done in zip(session.samples, pending, strict=True):
            sample.persisted = done
        self._versions[sid] = int(results[version_at])
        if refresh:
            self._ttl_refreshed[sid] = time.monotonic()

    def _queue_sample(self, pipe: Any, sid: str, sample: SessionSample, created: list[str]) -> dict[str, Any]:
        """Queue the writes of what ``sample`` gained since it was last written; returns its bookkeeping after
        them (kept once the transaction succeeded). Keys this write creates are added to ``created`` (they need
        their TTL; a rewrite keeps the key's own, ``KEEPTTL``)."""
        done = dict(sample.persisted) or {"id": secrets.token_hex(6), "arrays": {}, "turns": 0, "text": 0}
        if not sample.persisted:
            created.append(self._sample_key(sid, done["id"], "meta"))
        arrays = dict(done["arrays"])
        for name in ARRAYS:
            buffer: GrowableArray | None = getattr(sample, name)
            if buffer is None:
                continue
            key = self._sample_key(sid, done["id"], name)
            state = (buffer.generation, len(buffer))
            written = arrays.get(name)
            if written is not None and tuple(written) == state:
                continue
            if written is not None and written[0] == buffer.generation and written[1] <= len(buffer):
                pipe.append(key, buffer.view()[written[1] :].tobytes())
            else:
                pipe.set(key, buffer.view().tobytes(), keepttl=True)
                if written is None:
                    created.append(key)
            arrays[name] = state
        turns = sample.turns
        if len(turns) < done["turns"]:
            pipe.delete(self._sample_key(sid, done["id"], "turns"))
            done["turns"] = 0
        if len(turns) > done["turns"]:
            new = [orjson.dumps(turn.to_json()) for turn in turns[done["turns"] :]]
            pipe.rpush(self._sample_key(sid, done["id"], "turns"), *new)
            if not done["turns"]:  # the list starts here
                created.append(self._sample_key(sid, done["id"], "turns"))
        text = sample.response
        text_key = self._sample_key(sid, done["id"], "text")
        if len(text) < done["text"]:
            pipe.set(text_key, text.encode(), keepttl=True)
        elif len(text) > done["text"]:
            pipe.append(text_key, text[done["text"] :].encode())
            if not done["text"]:
                created.append(text_key)
        pipe.set(self._sample_key(sid, done["id"], "meta"), orjson.dumps(_sample_meta(sample)), keepttl=True)
        return {"id": done["id"], "arrays": arrays, "turns": len(turns), "text": len(text)}

    # ---- reading a whole session -----------------------------------------------------------------------------
    async def _load(self, session_id: str) -> Session:
        key = self._key(session_id)
        with self._errors("read"):
            fields = {k.decode(): v for k, v in (await self.redis.hgetall(key)).items()}
            if "samples" not in fields:
                self._forget(session_id)
                raise SessionNotFound(f"no session {session_id!r}", session_id=session_id)
            sample_ids = orjson.loads(fields["samples"])
            async with self.redis.pipeline(transaction=False) as pipe:
                for sample_id in sample_ids:
                    pipe.get(self._sample_key(session_id, sample_id, "meta"))
                    for name in ARRAYS:
                        pipe.get(self._sample_key(session_id, sample_id, name))
                    pipe.lrange(self._sample_key(session_id, sample_id, "turns"), 0, -1)
                    pipe.get(self._sample_key(session_id, sample_id, "text"))
                answers = await pipe.execute()
        per_sample = len(ARRAYS) + 3
        samples = [
            _read_sample(sample_id, answers[i * per_sample : (i + 1) * per_sample])
            for i, sample_id in enumerate(sample_ids)
        ]
        chat = fields.get("chat") or b""
        session = Session(
            session_id=session_id,
            sample=samples[-1],
            branches=samples[:-1],
            metadata=orjson.loads(fields["metadata"]),
            sampling_defaults=orjson.loads(fields["sampling_defaults"]),
            created_at=float(fields["created_at"]),
            updated_at=float(fields["updated_at"]),
            chat=ChatRecord.from_json(orjson.loads(chat)) if chat else None,
        )
        self._register(session)
        self._versions[session_id] = int(fields["version"])
        self._trim_cache()
        return session

    # ---- the local copies ------------------------------------------------------------------------------------
    def _forget(self, session_id: str) -> None:
        session = self._sessions.pop(session_id, None)
        self._versions.pop(session_id, None)
        self._ttl_refreshed.pop(session_id, None)
        if session is not None:
            self._stored_bytes -= session.counted_bytes

    def _trim_cache(self) -> None:
        limit = self._cache_bytes
        if limit is None or self._stored_bytes <= limit:
            return
        for session in sorted(self._sessions.values(), key=lambda s: s.updated_at):
            if self._stored_bytes <= limit:
                break
            if not session.busy:
                self._forget(session.session_id)


def _sample_meta(sample: SessionSample) -> dict[str, Any]:
    return {
        "prompt_length": sample.prompt_length,
        "moe": None if sample.moe is None else [sample.moe.num_layers, sample.moe.topk],
        "status": sample.status.value,
        "weight_versions": sample.weight_versions,
        "weight_version_table": sample.weight_version_table,
        "cached_tokens": sample.cached_tokens,
        "prompt_tokens": sample.prompt_tokens,
        "spec_counters": sample.spec_counters,
        "routing_dtype": None if sample.routed_experts is None else sample.routed_experts.dtype.str,
    }


def _read_sample(sample_id: str, answers: list[Any]) -> SessionSample:
    meta = orjson.loads(answers[0])
    moe = None if meta["moe"] is None else MoEShape(*meta["moe"])
    raw = dict(zip(ARRAYS, answers[1 : 1 + len(ARRAYS)], strict=True))
    turns, text = answers[1 + len(ARRAYS)], answers[2 + len(ARRAYS)] or b""

    def array(name: str) -> GrowableArray | None:
        data = raw[name]
        if data is None:
            return None
        if name == "routed_experts":
            assert moe is not None
            rows = np.frombuffer(data, dtype=np.dtype(meta["routing_dtype"])).reshape(-1, moe.num_layers, moe.topk)
            return GrowableArray.from_array(rows)
        return GrowableArray.from_array(np.frombuffer(data, dtype=ARRAYS[name]))

    def required(name: str) -> GrowableArray:
        return array(name) or GrowableArray(ARRAYS[name])  # an empty array is written as no key at all

    sample = SessionSample(
        prompt_length=meta["prompt_length"],
        tokens=required("tokens"),
        moe=moe,
        loss_mask=required("loss_mask"),
        log_probs=required("log_probs"),
        top_p_ids=array("top_p_ids"),
        top_p_offsets=array("top_p_offsets"),
        routed_experts=array("routed_experts"),
        status=Status(meta["status"]),
        weight_versions=meta["weight_versions"],
        weight_version_table=meta["weight_version_table"],
        weight_version_ids=required("weight_version_ids"),
        cached_tokens=meta["cached_tokens"],
        prompt_tokens=meta["prompt_tokens"],
        spec_counters=meta["spec_counters"],
        turns=[TurnRecord(**orjson.loads(turn)) for turn in turns],
        _text_pieces=[text.decode()] if text else [],
    )
    arrays = {
        name: (buffer.generation, len(buffer))
        for name in ARRAYS
        if raw[name] is not None and (buffer := getattr(sample, name)) is not None
    }
    sample.persisted = {"id": sample_id, "arrays": arrays, "turns": len(sample.turns), "text": len(sample.response)}
    return sample
