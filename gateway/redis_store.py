"""The Redis session store (``GATEWAY_STORE=redis://host:port/db``, or ``redis+cluster://host:port`` for a Redis
Cluster): sessions that survive restarts and that any gateway replica serves.

Each replica keeps the sessions it touches in memory, as the in-memory store does (the fold, the views and the
sample encodes run on those arrays unchanged), and Redis holds the truth:

- **Appends cost the new bytes.** Every array of a sample is one Redis string; a turn ``APPEND``s the items it added
  (``GrowableArray.generation`` says whether earlier items changed, as when an upstream resends all routing rows:
  then the string is rewritten). The turn log is a list (``RPUSH``), the response text a string (``APPEND``), the
  small fields (status, counters, metadata, the chat record) a hash, written only when they changed.
- **One round trip per write, all or nothing.** What one turn or append changed is written when the session is
  released, by one server-side script (``WRITE``) that checks the lease, applies every change and lets the lease go.
  A replica killed before it leaves Redis as before the turn; a write that fails is a 503 ``store_unavailable``, and
  the local copy is dropped so the next request reads Redis again.
- **One turn at a time, across replicas.** A turn holds a lease (``ACQUIRE``: taken only on a session that exists,
  in the same round trip that reads its stamp), renewed while it runs, so a second turn from any replica is a 409 and
  a replica that dies mid-turn frees the session when the lease runs out. Only the lease's holder can write.
- **A session is its incarnation and its stamp, not its id.** ``incarnation`` is drawn at create, ``stamp`` at every
  write (random, never a counter): a replica uses its copy only while both equal Redis's. A session deleted and
  created again under the same id (by any replica, by the idle sweep, by a re-sent create), or rolled back by a
  Redis restarted from an older snapshot, has another incarnation or stamp, so the copy is reloaded, and a write
  based on a copy that is not Redis's is refused by the script itself.
- **Late commands are fenced.** A command that reaches Redis after its request gave up (Redis paused past
  ``SOCKET_TIMEOUT_S``: the request answered 503) neither takes a lease nor writes: the scripts compare Redis's clock
  with a deadline the replica sets (``FENCE_S`` after sending, on Redis's clock as last measured). Connections
  found dead (Redis restarted) are retried once: every script is safe to run twice.
- **Keys no session id can collide with, one slot per session.** Every key of a session is
  ``PREFIX:s:{ID}...`` with ``%``, ``{`` and ``}`` escaped in the id: the braces are the Redis Cluster hash tag (all of
  a session's keys in one slot, so its scripts run on one node), and no id's keys can be another's.

Aborts go to the replica running the turn (``POST /abort`` elsewhere answers which instance holds it).
``GATEWAY_MAX_STORED_BYTES`` bounds the bytes a replica keeps in memory: past it, the least recently used idle
sessions are dropped from memory (they stay in Redis).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import orjson
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    ClusterDownError,
    MasterDownError,
    NoScriptError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.buffers import GrowableArray
from gateway.chat.conversation import ChatRecord
from gateway.errors import SessionBusy, SessionExists, SessionNotFound, StoreUnavailable
from gateway.sample import MoEShape, SessionSample, Status, TurnRecord
from gateway.store import Branch, Session, SessionLimits, SessionQuery, SessionStore, Trajectory, page_of

log = logging.getLogger("gateway.redis_store")

Client = aioredis.Redis | RedisCluster
T = TypeVar("T")
# What a store failing over answers (a node down or frozen, a cluster electing a new master, a write reaching a demoted
# one): ``RedisSessionStore._patient`` sends the command again while retry_s lasts.
TRANSIENT = (
    RedisConnectionError,
    RedisTimeoutError,
    ClusterDownError,
    TryAgainError,
    ReadOnlyError,
    MasterDownError,
    RedisClusterException,
)
# What the store's background work (heartbeats, renewals, the channel, index repairs) and its best-effort reads survive:
# Redis's errors, and the AttributeError / RuntimeError redis-py's asyncio cluster client can raise from a command
# whose connection a failover closed under it (``_patient`` turns those into the lost connection they are).
REDIS_FAILURES = (RedisError, RedisClusterException, OSError, AttributeError, RuntimeError)
Staged = Sequence[tuple[str, memoryview]]
Wait = tuple[int, int]  # replicas, timeout (ms)

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
SMALL_PARTS = ("meta", "turns", "text")  # a sample's keys besides its arrays' chunks
_NOT_PENDING = object()
SOCKET_TIMEOUT_S = 5.0
# A script that runs later than this after its command was sent does nothing: its request gives up at
# SOCKET_TIMEOUT_S, and the second between leaves room for the answer to arrive before that.
FENCE_S = SOCKET_TIMEOUT_S - 1.0
READ_ATTEMPTS = 3  # a whole-session read, or a delete, retried while writes land in between
# New array bytes from this size on are not passed to the write script (a Lua string costs Redis ~4x the CPU of a
# plain SET of the same bytes): they are SET under a staging key in the same round trip, and the script renames that
# key into the array's next chunk (O(1)). Smaller ones are appended to the array's last chunk while it is below
# CHUNK_BYTES.
STAGE_BYTES = 64 * 1024
CHUNK_BYTES = 1024 * 1024
STAGE_TTL_MS = 60_000  # a staging key whose write never ran (its answer lost, the replica killed) goes by itself
# How long a create (or a write that refreshes the index) waits for its index update, which is not part of its commit,
# before it answers anyway: the update goes on in the background, and is repaired if it fails.
INDEX_WAIT_S = 1.0
# A lease whose value ends so belongs to a replica that heartbeats; its heartbeat lasts this many beats.
HEARTBEAT_MARK = ":h"
HEARTBEAT_MISSES = 5  # longer than a Redis Cluster failover, during which no beat gets through

# Every command the store sends Redis and every command its scripts run (Redis checks those against the user's ACL
# too): all its ACL user needs (``acl_rules``). The cluster client also asks the nodes for their map of the slots.
REDIS_COMMANDS = (
    # the store's own
    "evalsha", "eval", "script|load", "get", "mget", "set", "del", "exists", "hget", "hmget", "hgetall", "lrange",
    "zadd", "zrem", "zcard", "zrange", "zrangebyscore", "time", "wait", "publish", "subscribe",
    # its scripts'
    "hset", "append", "rename", "pexpire", "persist", "rpush",
)  # fmt: skip
CLUSTER_COMMANDS = ("cluster|slots", "command")  # redis-py reads the slot map and the commands' key positions
# Not needed, and not listed: redis-py names each connection with CLIENT SETINFO (Redis 7.2+) and goes on when it is
# refused (Redis 7.2+ then logs the refusal in ACL LOG: add +client|setinfo to keep the log quiet).


def acl_rules(prefix: str, *, cluster: bool = False) -> list[str]:
    """The ``ACL SETUSER`` rules of a user that may do all the store does and nothing else: its keys (``PREFIX:*``),
    its channel (``PREFIX:fleet``), its commands. Add the password (``>...``) and, for the user to exist, ``on``."""
    commands = (*REDIS_COMMANDS, *(CLUSTER_COMMANDS if cluster else ()))
    return ["resetkeys", f"~{prefix}:*", "resetchannels", f"&{prefix}:fleet", "-@all", *(f"+{c}" for c in commands)]


# "#!lua": Redis 7's script flags, none given: a script that may write is refused whole when Redis is out of memory
# (never half run), and on a cluster it may touch only the keys it declares (one slot).
_NOW_MS = """#!lua
local function past(deadline)
  deadline = tonumber(deadline)
  if deadline == 0 then return false end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) > deadline
end
"""

# KEYS: the session's hash, its lease. ARGV: the lease value, its time to live (ms), the deadline (ms on Redis's
# clock, 0: none), the lease value of a holder found dead that this lease replaces ('': none). Answers {'ok',
# incarnation, stamp}, {'busy', holder}, {'missing'} or {'late'}. Run twice (a resend after a lost answer), it answers
# 'ok' again: the lease holds its own value.
_ACQUIRE = (
    _NOW_MS
    + """
if past(ARGV[3]) then return {'late'} end
local found = redis.call('HMGET', KEYS[1], 'incarnation', 'stamp')
if not found[2] then return {'missing'} end
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[1] and holder ~= ARGV[4] then return {'busy', holder} end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return {'ok', found[1] or '', found[2]}
"""
)

# KEYS[1]: the session's hash, KEYS[2]: its lease, KEYS[3 .. 2+s]: the s staging keys SET just before, then the keys
# the operations name. ARGV: 1 the lease value ('' to create the session), 2 the incarnation, 3 the stamp the write
# is based on ('' to create), 4 the new stamp, 5 the deadline, 6 the keys' TTL (ms, 0: none), 7 s, 8 the number n of
# hash fields, 9 '1' to keep the lease (this replica runs turns on other branches of the session), then n
# field/value pairs, then operations as (code, key index, value) triples. Answers 'ok', 'done'
# (this very write already happened: a resend), 'exists' (create), 'lease' (not the lease's holder), 'stale' (the
# session is not the one the write is based on), 'lost' (a staging key is gone) or 'late'; only 'ok' changed
# anything (every check comes before the first change: a script's changes are not rolled back). The lease is let
# go on 'ok', 'stale' and 'late' (the request that holds it ends with this answer); staging keys always are.
_WRITE = (
    _NOW_MS
    + """
local staged = 2 + tonumber(ARGV[7])
local function refuse(answer)
  for k = 3, staged do redis.call('DEL', KEYS[k]) end
  return answer
end
local found = redis.call('HMGET', KEYS[1], 'incarnation', 'stamp')
if found[2] == ARGV[4] then
  -- Already written (a resend): the same stamp again, so that a WAIT after this command covers that write too.
  redis.call('HSET', KEYS[1], 'stamp', ARGV[4])
  return refuse('done')
end
local mine = ARGV[1] ~= '' and redis.call('GET', KEYS[2]) == ARGV[1]
if past(ARGV[5]) then
  if mine then redis.call('DEL', KEYS[2]) end
  return refuse('late')
end
if ARGV[3] == '' then
  if found[2] then return refuse('exists') end
elseif not mine then
  return refuse('lease')
elseif found[1] ~= ARGV[2] or found[2] ~= ARGV[3] then
  redis.call('DEL', KEYS[2])
  return refuse('stale')
end
for k = 3, staged do
  if redis.call('EXISTS', KEYS[k]) == 0 then return refuse('lost') end
end
local ttl = tonumber(ARGV[6])
local i = 10
for _ = 1, tonumber(ARGV[8]) do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  i = i + 2
end
redis.call('HSET', KEYS[1], 'incarnation', ARGV[2], 'stamp', ARGV[4])
while i <= #ARGV do
  local code, key, value = ARGV[i], KEYS[tonumber(ARGV[i + 1])], ARGV[i + 2]
  if code == 'A' then redis.call('APPEND', key, value)
  elseif code == 'S' then redis.call('SET', key, value, 'KEEPTTL')
  elseif code == 'M' then
    redis.call('RENAME', KEYS[tonumber(value)], key)
    if ttl > 0 then redis.call('PEXPIRE', key, ttl) else redis.call('PERSIST', key) end
  elseif code == 'R' then redis.call('RPUSH', key, value)
  elseif code == 'D' then redis.call('DEL', key)
  elseif code == 'E' then redis.call('PEXPIRE', key, ttl)
  end
  i = i + 3
end
if mine and ARGV[9] ~= '1' then redis.call('DEL', KEYS[2]) end
return 'ok'
"""
)

# KEYS[1]: the session's hash, KEYS[2]: its lease, KEYS[3..]: its other keys, as listed at stamp ARGV[1]. ARGV[2]:
# delete only if idle since then (its updated_at, seconds; '': whatever it is); ARGV[3]: the lease of a holder found
# dead, which does not keep the session ('': none). Answers {'ok'}, {'missing'}, {'changed'} (written since it was
# listed: list again), {'busy', holder} or {'fresh', updated_at}.
_DELETE = """#!lua
local found = redis.call('HMGET', KEYS[1], 'stamp', 'updated_at')
if not found[1] then return {'missing'} end
if found[1] ~= ARGV[1] then return {'changed'} end
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[3] then return {'busy', holder} end
if ARGV[2] ~= '' and tonumber(found[2]) >= tonumber(ARGV[2]) then return {'fresh', found[2]} end
for _, key in ipairs(KEYS) do redis.call('DEL', key) end
return {'ok'}
"""

# KEYS[1]: the session's hash. Marks the session closed (``SessionStore.close``) if it exists: a field of its own, which
# no write touches and every replica's ``get`` reads with the stamp. Answers 1, or 0 for no such session.
_CLOSE = """#!lua
if not redis.call('HGET', KEYS[1], 'stamp') then return 0 end
redis.call('HSET', KEYS[1], 'closed', '1')
return 1
"""

# Deletes the lease, or extends it, only while it is ours (a lease that ran out may be another replica's now).
_UNLOCK = "#!lua\nif redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"
_RENEW = (
    "#!lua\nif redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) "
    "else return 0 end"
)


class Script:
    """A Lua script run by its digest (``EVALSHA``), sent whole (``EVAL``, which also caches it) when the server does
    not know it yet: a fresh or restarted Redis, a new cluster node."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    async def __call__(
        self, client: Client, keys: list[str], args: list[Any], staged: Staged = (), wait: Wait | None = None
    ) -> Any:
        """Its answer; ``staged`` (key, bytes) pairs are SET (with a TTL of STAGE_TTL_MS) in the same round trip,
        before it. ``wait`` (replicas, timeout in ms): then ``WAIT`` for that many replicas to have the script's
        writes, on the same connection, and the answer is (the script's answer, how many replicas confirmed)."""
        try:
            return await self._run(client, "EVALSHA", self.sha, keys, args, staged, wait)
        except NoScriptError:
            return await self._run(client, "EVAL", self.text, keys, args, staged, wait)

    @staticmethod
    async def _run(
        client: Client, command: str, script: str, keys: list[str], args: list[Any], staged: Staged, wait: Wait | None
    ) -> Any:
        if not staged and wait is None:
            return await client.execute_command(command, script, len(keys), *keys, *args)
        node = client.get_node_from_key(keys[0]) if wait is not None and isinstance(client, RedisCluster) else None
        async with client.pipeline(transaction=False) as pipe:
            for key, payload in staged:
                pipe.set(key, payload, px=STAGE_TTL_MS)
            pipe.execute_command(command, script, len(keys), *keys, *args)  # (a cluster pipeline has no .evalsha)
            if wait is None:
                return (await pipe.execute())[-1]
            # WAIT counts the replicas that have this connection's writes: it must go on the script's connection,
            # which a pipeline's commands for one node share (on a cluster: sent to the node of the keys' slot).
            pipe.execute_command("WAIT", wait[0], wait[1], **({} if node is None else {"target_nodes": node}))
            answers = await pipe.execute(raise_on_error=False)
        for answer in answers[:-1]:
            if isinstance(answer, Exception):
                raise answer
        moved = node is not None and client.get_node_from_key(keys[0]).name != node.name
        if isinstance(answers[-1], Exception) or moved:
            # The script was redirected to another node (a failover: MOVED) and ran there, its WAIT did not (it
            # failed on the old node, or counted another connection's writes): send it again, which answers done
            # and waits on the right connection.
            raise TryAgainError(f"the write's node changed under it ({answers[-1] if not moved else 'moved'})")
        return answers[-2], int(answers[-1])


class Keys:
    """The store's key names. A session's keys share the hash tag ``{ID}`` (one Redis Cluster slot), the id escaped so
    that no id's keys can be another's: ``%``, ``{`` and ``}`` become ``%25``, ``%7B`` and ``%7D``, and what follows
    the tag is the store's own."""

    def __init__(self, prefix: str) -> None:
        if "{" in prefix or "}" in prefix:
            raise ValueError("the Redis key prefix must not hold '{' or '}' (the hash tag is the session's)")
        self.prefix = prefix
        self.index = f"{prefix}:index"

    def session(self, session_id: str) -> str:
        tag = session_id.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")
        return f"{self.prefix}:s:{{{tag}}}"

    @property
    def fleet(self) -> str:
        """The channel of gateway-wide actions (``gateway.fleet``)."""
        return f"{self.prefix}:fleet"

    def instance(self, instance_id: str) -> str:
        """A gateway replica's heartbeat (``RedisSessionStore._heartbeats``). Every replica's in one slot (the hash
        tag ``{instances}``), so that one round trip reads a holder's and one's own."""
        return f"{self.prefix}:{{instances}}:{instance_id}"

    @staticmethod
    def lease(session_key: str) -> str:
        return f"{session_key}:lease"

    @staticmethod
    def part(session_key: str, sample_id: str, part: str) -> str:
        return f"{session_key}:x:{sample_id}:{part}"

    @staticmethod
    def chunk(session_key: str, sample_id: str, array: str, number: int) -> str:
        return f"{session_key}:x:{sample_id}:{array}:{number}"

    @staticmethod
    def stage(session_key: str, stamp: str, number: int) -> str:
        return f"{session_key}:stage:{stamp}:{number}"

    @staticmethod
    def all(session_key: str, layout: list[dict[str, Any]]) -> list[str]:
        """Every key of a session whose samples are ``layout`` (the hash's ``samples``: each one's id and the chunks
        of each of its arrays)."""
        keys = [session_key]
        for sample in layout:
            keys += [Keys.part(session_key, sample["id"], part) for part in SMALL_PARTS]
            for array, chunks in sample["chunks"].items():
                keys += [Keys.chunk(session_key, sample["id"], array, n) for n in range(chunks)]
        return keys


def connect(url: str) -> Client:
    """A client for ``redis[s]://`` (one server) or ``redis[s]+cluster://`` (a seed node of a Redis Cluster).

    Retries: a connection found dead (Redis restarted since it was pooled) is retried once at once; a timeout is not
    (the scripts fence a late command themselves). The cluster client also retries once after refreshing its map of
    the slots (a node failed over)."""
    common: dict[str, Any] = {"socket_timeout": SOCKET_TIMEOUT_S, "socket_connect_timeout": SOCKET_TIMEOUT_S}
    scheme, rest = url.split("://", 1)
    if scheme.endswith("+cluster"):
        return RedisCluster.from_url(
            f"{scheme.removesuffix('+cluster')}://{rest}", retry=Retry(NoBackoff(), 1), **common
        )
    return aioredis.from_url(url, retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)), **common)


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
        heartbeat_s: float = 0.0,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
        retry_s: float = 0.0,
    ) -> None:
        super().__init__(max_sessions, max_session_tokens=max_session_tokens, max_stored_bytes=None)
        self._url = url
        self._keys = Keys(prefix)
        self._lease_ms = int(lease_s * 1000)
        # This replica says it is alive every heartbeat_s (its instance key, HEARTBEAT_MISSES beats long): a lease of a
        # replica whose key is gone is taken over at once rather than waited out (0: no heartbeat, leases run out).
        self._heartbeat_s = heartbeat_s
        self._wait: Wait | None = (wait_replicas, wait_timeout_ms) if wait_replicas else None
        self._retry_s = retry_s  # how long a command is sent again while the store fails over (``_patient``)
        self._instance = instance_id
        self._cache_bytes = max_stored_bytes
        # Redis drops a session's keys by itself once it is idle this long (0: never), even with no gateway left to
        # sweep: twice the sweep's TTL, so the sweep (which also keeps the index) normally comes first.
        self._key_ttl_ms = int(2 * idle_ttl_s * 1000)
        self._ttl_refreshed: dict[str, float] = {}  # session id -> when this replica last pushed its TTLs and score
        self._redis: Client | None = None
        self._leases: dict[str, str] = {}  # session id -> the lease value this replica holds
        self._holds: dict[str, int] = {}  # session id -> turns running here under that lease (one per branch)
        self._cached: dict[str, tuple[str, str]] = {}  # session id -> (incarnation, stamp) of the local copy
        self._written: dict[str, dict[str, bytes]] = {}  # session id -> its hash's small fields, as Redis has them
        # session id -> the index update that failed and waits for its repair: a score to add, or None (remove)
        self._index_pending: dict[str, float | None] = {}
        self._clock_offset_s: float | None = None  # Redis's clock less ours (the latest of a cluster's primaries)
        self._count = 0
        self._renewer: asyncio.Task[None] | None = None
        self._heart: asyncio.Task[None] | None = None
        self.listening: bool | None = False
        self._cleanups: set[asyncio.Task[None]] = set()
        self._scripts = [Script(text) for text in (_ACQUIRE, _WRITE, _DELETE, _UNLOCK, _RENEW, _CLOSE)]
        self._acquire_script, self._write_script, self._delete_script, self._unlock_script, self._renew_script = (
            self._scripts[:5]
        )
        self._close_script = self._scripts[5]

    # ---- life ------------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._redis = connect(self._url)
        try:
            with self._errors("start"):
                await self._measure_clock()
                await self._refresh_count()
                for script in self._scripts:  # known to Redis from the first request (EVALSHA needs no EVAL)
                    await self.redis.script_load(script.text)
            log.info("session store: Redis %s (prefix %r), %d sessions", self._safe_url, self._keys.prefix, self._count)
        except StoreUnavailable as exc:  # serve anyway: requests get 503s until Redis is back
            log.error("session store: Redis %s unreachable at start: %s", self._safe_url, exc.message)
        self._renewer = asyncio.create_task(self._renew_leases(), name="redis-leases")
        if self._heartbeat_s:
            self._heart = asyncio.create_task(self._heartbeats(), name="redis-heartbeat")

    async def aclose(self) -> None:
        for task in (self._renewer, self._heart, *self._cleanups):
            if task is not None:
                task.cancel()
        for session_id, value in list(self._leases.items()):
            with contextlib.suppress(RedisError, RedisClusterException, OSError):
                await self._unlock(session_id, value)
        if self._redis is not None:
            if self._heartbeat_s:  # gone now: its leases are let go above, nothing waits for its key to run out
                with contextlib.suppress(RedisError, RedisClusterException, OSError):
                    await self._redis.delete(self._keys.instance(self._instance))
            await self._redis.aclose()

    @property
    def _safe_url(self) -> str:
        return self._url.split("@")[-1]  # never a password from the URL in a log

    @property
    def count(self) -> int:
        return self._count

    @property
    def redis(self) -> Client:
        if self._redis is None:
            raise StoreUnavailable("the Redis session store is not started")
        return self._redis

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except (RedisError, RedisClusterException, OSError) as exc:
            raise StoreUnavailable(f"{what}: the Redis session store failed: {exc}", reason="redis") from exc

    async def _patient(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call()``, sent again while the store answers as one failing over does (``TRANSIENT``), for up to retry_s:
        every command the store sends is safe to run twice (its scripts answer a resend as done, reads and index
        updates are idempotent), and ``call`` builds its command afresh each time (a new fence deadline). The last
        failure is raised as it is (``_errors`` makes it a 503)."""
        give_up = time.monotonic() + self._retry_s
        pause = 0.05
        while True:
            try:
                try:
                    return await call()
                except (AttributeError, RuntimeError) as exc:
                    # redis-py's asyncio cluster client, when a failover makes it drop a node's connections, can
                    # raise these from a command whose connection closed under it: a lost connection, as they mean.
                    raise RedisConnectionError(f"the connection closed under the command ({exc!r})") from exc
            except TRANSIENT as exc:
                if time.monotonic() + pause >= give_up:
                    raise
                log.info("session store: %s; sending it again in %.2fs", exc, pause)
                await asyncio.sleep(pause)
                pause = min(2 * pause, 1.0)

    def _token(self) -> str:
        """A lease's value: the instance, a random part, and (``HEARTBEAT_MARK``) whether the instance heartbeats,
        so that only such a lease is ever taken over (a replica of a version without heartbeats never is)."""
        mark = HEARTBEAT_MARK if self._heartbeat_s else ""
        return f"{self._instance}:{secrets.token_hex(8)}{mark}"

    def _deadline_ms(self) -> int:
        """When a command sent now must have run by, on Redis's clock (0: no fence until the clock is measured)."""
        if self._clock_offset_s is None:
            return 0
        return int((time.time() + self._clock_offset_s + FENCE_S) * 1000)

    # ---- the store API ---------------------------------------------------------------------------------------
    async def create(
        self,
        sample: SessionSample,
        *,
        session_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        sampling_defaults: dict[str, Any] | None = None,
        limits: SessionLimits | None = None,
        resume: bool = False,
    ) -> Session:
        session = self._new_session(sample, session_id, metadata, sampling_defaults, limits, resume)
        sid = session.session_id
        # Against the count as last seen (refreshed with the leases): a create depends on its own session's node
        # only, never on the index's.
        self._check_session_count(self._count)
        with self._errors("create"):
            answer = await self._write(session, lease="", incarnation=secrets.token_hex(8), base="")
        if answer == "exists":
            raise SessionExists(f"session {sid!r} already exists", session_id=sid)
        self._check_written(sid, answer)
        self._register(session)
        self._count += 1
        return session

    async def get(self, session_id: str) -> Session:
        local = self._sessions.get(session_id)
        if local is not None and local.busy:  # a turn runs here: this copy is the newest there is
            return local
        with self._errors("read"):
            key = self._keys.session(session_id)
            incarnation, stamp, closed = await self._patient(
                lambda: self.redis.hmget(key, "incarnation", "stamp", "closed")
            )
        if stamp is None:
            self._forget(session_id)
            raise SessionNotFound(f"no session {session_id!r}", session_id=session_id)
        session = await self._fresh(session_id, ((incarnation or b"").decode(), stamp.decode()))
        session.closed = session.closed or closed is not None  # closed by any replica, at no extra round trip
        return session

    async def close(self, session_id: str) -> Session:
        with self._errors("close"):
            key = self._keys.session(session_id)
            found = await self._patient(lambda: self._close_script(self.redis, [key], []))  # idempotent: safe to resend
        if not found:
            self._forget(session_id)
            raise SessionNotFound(f"no session {session_id!r}", session_id=session_id)
        session = await self.get(session_id)
        session.closed = True  # a turn running here keeps this copy as it is (``get`` does not read Redis then)
        return session

    async def _fresh(self, session_id: str, current: tuple[str, str]) -> Session:
        """The session as Redis has it now (``current``: its incarnation and stamp): the local copy when it is that
        one, else loaded."""
        local = self._sessions.get(session_id)
        if local is not None and self._cached.get(session_id) == current:
            return local
        return await self._load(session_id)

    async def acquire(self, session_id: str) -> Trajectory:
        session = await self._take_lease(session_id)
        return await self._hold_branch(session, session.branches[0])

    async def hold(self, session: Session, branch: Branch) -> Trajectory:
        """The lease (unless this replica holds it for another branch's turn), then the branch; a session that
        changed in Redis since ``session`` was read is a 409 (planned against an old copy: send it again)."""
        await self._lease_as_planned(session, branch)
        return await self._hold_branch(session, branch)

    async def start_branch(self, session: Session, branch: Branch) -> Trajectory:
        await self._lease_as_planned(session)
        session.branches.append(branch)
        trajectory = await self._hold_branch(session, branch)
        self.recount(session)
        return trajectory

    async def _lease_as_planned(self, session: Session, branch: Branch | None = None) -> None:
        """The lease for a turn planned against ``session`` (on its ``branch``): a 409 when Redis has another copy
        of the session now (or that copy lacks the branch)."""
        current = await self._take_lease(session.session_id)
        if current is not session or (branch is not None and branch not in session.branches):
            await self._put_back(session.session_id)
            raise SessionBusy(
                f"session {session.session_id!r} changed while this request was planned; send it again",
                session_id=session.session_id,
            )

    async def _hold_branch(self, session: Session, branch: Branch) -> Trajectory:
        try:
            return await SessionStore.hold(self, session, branch)
        except BaseException:
            await self._put_back(session.session_id)
            raise

    async def _take_lease(self, session_id: str) -> Session:
        """This replica's hold on the session (one lease per session and replica, however many of its branches run
        a turn here): taken in Redis with the stamp's read, or counted when already held; the session as Redis has
        it."""
        if session_id in self._leases:
            local = self._sessions.get(session_id)
            if local is None:  # a failed write dropped it while another branch's turn ran here
                raise StoreUnavailable(f"session {session_id!r}: this replica lost track of it", reason="stale")
            self._holds[session_id] += 1
            return local
        key = self._keys.session(session_id)
        value = self._token()
        try:
            with self._errors("hold"):
                answer = await self._acquire(key, value)
                if answer[0] == b"busy" and await self._holder_is_dead(answer[1].decode()):
                    answer = await self._acquire(key, value, replacing=answer[1].decode())
                    if answer[0] == b"ok":
                        log.info("session %s: took over the hold of a gateway that stopped", session_id)
        except StoreUnavailable:
            self._let_go(session_id, value)  # in case it ran and only its answer was lost
            raise
        status = answer[0].decode()
        if status == "missing":
            self._forget(session_id)
            raise SessionNotFound(f"no session {session_id!r}", session_id=session_id)
        if status == "busy":
            owner = answer[1].decode().split(":")[0]
            raise SessionBusy(
                f"session {session_id!r} already has a turn running (on gateway instance {owner})",
                session_id=session_id,
                instance_id=owner,
            )
        if status == "late":
            raise StoreUnavailable("hold: Redis ran the command too late (it was paused or overloaded)", reason="redis")
        self._leases[session_id] = value  # renewed from now on, while the copy is loaded too
        self._holds[session_id] = 1
        try:
            return await self._fresh(session_id, (answer[1].decode(), answer[2].decode()))
        except BaseException:
            await self._put_back(session_id)
            raise

    async def _acquire(self, key: str, value: str, replacing: str = "") -> Any:
        return await self._patient(
            lambda: self._acquire_script(
                self.redis, [key, Keys.lease(key)], [value, self._lease_ms, self._deadline_ms(), replacing]
            )
        )

    async def _holder_is_dead(self, holder: str) -> bool:
        """Whether the replica holding a lease (its value ``holder``) stopped: it heartbeats (``HEARTBEAT_MARK``) and
        its heartbeat ran out while this replica's own is there. Any doubt counts as alive: the heartbeats' node
        unreachable, or this replica's own heartbeat missing too (that node frozen or failed over, so that no beat got
        through). A lease is taken over only on proof, and even then a replica that was only slow loses nothing (its
        write is refused: nothing written)."""
        instance = holder.split(":")[0]
        if not holder.endswith(HEARTBEAT_MARK) or instance == self._instance:
            return False
        try:
            theirs, mine = await self.redis.mget([self._keys.instance(instance), self._keys.instance(self._instance)])
        except REDIS_FAILURES:
            return False
        return theirs is None and mine is not None

    async def _put_back(self, session_id: str) -> None:
        """Undo one ``_take_lease`` that no turn used: the last one lets the lease go (nothing to write)."""
        value, last = self._drop_hold(session_id)
        if value is not None and last:
            self._let_go(session_id, value)

    def _drop_hold(self, session_id: str) -> tuple[str | None, bool]:
        """Count one hold on the session off: (its lease, if any; whether that was the last hold, which takes the
        lease off the books: the caller lets it go in Redis)."""
        value = self._leases.get(session_id)
        if value is not None and self._holds.get(session_id, 0) > 1:
            self._holds[session_id] -= 1
            return value, False
        self._holds.pop(session_id, None)
        self._leases.pop(session_id, None)
        return value, True

    async def release(self, trajectory: Trajectory) -> None:
        session = trajectory.session
        sid = session.session_id
        value, last = self._drop_hold(sid)
        try:
            if value is not None:
                cached = self._cached.get(sid)
                if cached is None:
                    raise StoreUnavailable(f"session {sid!r}: this replica lost track of it mid-turn", reason="stale")
                only = trajectory.branch
                try:
                    with self._errors("write"):
                        answer = await self._write(
                            session, lease=value, incarnation=cached[0], base=cached[1], only=only, keep=not last
                        )
                except StoreUnavailable as exc:
                    log.warning("session %s: the write of what its turn changed failed: %s", sid, exc.message)
                    if last:
                        self._let_go(sid, value)  # no answer: whether it ran is unknown
                    raise
                self._check_written(sid, answer)
        except BaseException:
            self._unhold(trajectory)
            self._forget(sid)  # Redis holds the truth: the next request reads it
            raise
        self._unhold(trajectory)
        self._trim_cache()

    async def delete(self, session_id: str) -> None:
        outcome, holder = await self._delete(session_id, idle_before=None)
        if outcome == "missing":
            raise SessionNotFound(f"no session {session_id!r}", session_id=session_id)
        if outcome == "busy":
            raise SessionBusy(
                f"session {session_id!r} has a turn running (on gateway instance {holder}); abort or wait for it first",
                session_id=session_id,
                instance_id=holder,
            )

    async def list_sessions(self) -> list[dict[str, Any]]:
        async def read() -> tuple[list[str], list[Any]]:
            ids = [sid.decode() for sid in await self.redis.zrange(self._keys.index, 0, -1)]
            async with self.redis.pipeline(transaction=False) as pipe:
                for sid in ids:
                    key = self._keys.session(sid)
                    pipe.hget(key, "summary")
                    pipe.exists(Keys.lease(key))
                return ids, await pipe.execute()

        with self._errors("list"):
            ids, answers = await self._patient(read)
        self._count = len(ids)
        summaries = []
        for summary, busy in zip(answers[::2], answers[1::2], strict=True):
            if summary is not None:
                summaries.append(orjson.loads(summary) | {"busy": bool(busy)})
        return summaries

    async def list_page(self, query: SessionQuery) -> tuple[int, list[dict[str, Any]]]:
        """Over every session's stored listing row (``summary``): Redis has no index by status or metadata."""
        return page_of(await self.list_sessions(), query)

    async def holder(self, session_id: str) -> str | None:
        with self._errors("read"):
            value = await self._patient(lambda: self.redis.get(Keys.lease(self._keys.session(session_id))))
        if value is None or session_id in self._leases:
            return None
        return value.decode().split(":")[0]

    async def expire_idle(self, ttl_s: float, now: float | None = None) -> list[str]:
        """The idle sweep: never raises for Redis's failures (it runs again on its schedule); logs them."""
        cutoff = (time.time() if now is None else now) - ttl_s
        expired: list[str] = []
        try:
            with self._errors("expire"):
                idle = [sid.decode() for sid in await self.redis.zrangebyscore(self._keys.index, "-inf", cutoff)]
            for session_id in idle:  # the index's score may lag (see _write): the script checks the session's time
                if (await self._delete(session_id, idle_before=cutoff))[0] == "ok":
                    expired.append(session_id)
        except StoreUnavailable as exc:
            log.warning("session store: the idle sweep stopped early: %s", exc.message)
        return expired

    def _check_store_room(self, new_bytes: int) -> None:
        """The sessions are in Redis: a replica's memory holds only a cache of them (``_trim_cache``)."""

    # ---- gateway-wide actions: pub/sub on PREFIX:fleet --------------------------------------------------------
    shared = True

    async def broadcast(self, message: dict[str, Any]) -> int:
        with self._errors("publish"):
            return int(await self._patient(lambda: self.redis.publish(self._keys.fleet, orjson.dumps(message))))

    async def listen(self, on_message: Callable[[dict[str, Any]], None]) -> None:
        """Subscribed to the channel until cancelled, subscribing again (with a backoff) whenever the connection
        fails: a restarted Redis, a failed-over cluster node."""
        pause = 0.1
        while True:
            pubsub = self.redis.pubsub()
            try:
                await pubsub.subscribe(self._keys.fleet)
                async for message in pubsub.listen():
                    if message.get("type") == "subscribe":
                        self.listening, pause = True, 0.1
                    elif message.get("type") == "message":
                        try:
                            on_message(orjson.loads(message["data"]))
                        except (orjson.JSONDecodeError, TypeError) as exc:
                            log.warning("session store: an unreadable gateway-wide message: %s", exc)
            except (*REDIS_FAILURES, StoreUnavailable) as exc:
                log.warning("session store: the gateway-wide channel failed (%s); subscribing again", exc)
            finally:
                self.listening = False
                with contextlib.suppress(RedisError, RedisClusterException, OSError):
                    await pubsub.aclose()
            await asyncio.sleep(pause)
            pause = min(2 * pause, 2.0)

    # ---- leases ----------------------------------------------------------------------------------------------
    async def _unlock(self, session_id: str, value: str) -> None:
        await self._unlock_script(self.redis, [Keys.lease(self._keys.session(session_id))], [value])

    def _let_go(self, session_id: str, value: str) -> None:
        """Let a lease go that a failed request may hold (its command ran, its answer never came), in the
        background until Redis answers: a lease nobody renews runs out by itself after the lease time."""
        self._background(self._unlock_until_answered(session_id, value), "redis-let-go")

    def _background(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """``work`` in a task of its own, cancelled with the store."""
        task = asyncio.create_task(work, name=name)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        return task

    async def _unlock_until_answered(self, session_id: str, value: str) -> None:
        give_up = time.monotonic() + self._lease_ms / 1000
        pause = 0.05
        while time.monotonic() < give_up:
            try:
                await self._unlock(session_id, value)
                return
            except REDIS_FAILURES:
                await asyncio.sleep(pause)
                pause = min(2 * pause, 1.0)

    async def _renew_leases(self) -> None:
        while True:
            await asyncio.sleep(self._lease_ms / 3000)
            try:
                for session_id, value in list(self._leases.items()):
                    if self._leases.get(session_id) != value:  # released since the list was taken: being written
                        continue
                    key = Keys.lease(self._keys.session(session_id))
                    if not await self._renew_script(self.redis, [key], [value, self._lease_ms]):
                        log.warning("session %s: its hold ran out before it was renewed", session_id)
                await self._measure_clock()
                await self._refresh_count()
            except (*REDIS_FAILURES, StoreUnavailable) as exc:
                log.warning("session store: renewing holds failed: %s", exc)
            if not self._heartbeat_s:
                await self._repair_index()

    async def _heartbeats(self) -> None:
        """Every heartbeat_s: this replica's instance key, alive for HEARTBEAT_MISSES beats, and the index repairs."""
        key = self._keys.instance(self._instance)
        ttl_ms = int(self._heartbeat_s * HEARTBEAT_MISSES * 1000)
        alive = orjson.dumps({"instance_id": self._instance, "started_at": time.time()})
        while True:
            try:  # a beat that would wait longer than a beat (a frozen node) is dropped: the next one goes at once
                await asyncio.wait_for(self.redis.set(key, alive, px=ttl_ms), self._heartbeat_s)
            except (*REDIS_FAILURES, StoreUnavailable, TimeoutError) as exc:
                log.warning("session store: the heartbeat failed: %s", exc or "no answer within a beat")
                await asyncio.sleep(min(0.2, self._heartbeat_s))
                continue
            await self._repair_index()
            await asyncio.sleep(self._heartbeat_s)

    async def _refresh_count(self) -> None:
        with self._errors("count"):
            self._count = await self.redis.zcard(self._keys.index)

    async def _measure_clock(self) -> None:
        """How far Redis's clock is ahead of ours, for the deadlines of ``_deadline_ms``. On a cluster, the latest
        of the primaries' (a late command is then fenced up to the clocks' spread later, never early)."""
        before = time.time()
        if isinstance(self.redis, RedisCluster):
            answers = list((await self.redis.time(target_nodes=RedisCluster.PRIMARIES)).values())
        else:
            answers = [await self.redis.time()]
        ours = (before + time.time()) / 2
        self._clock_offset_s = max(seconds + micros / 1e6 for seconds, micros in answers) - ours

    # ---- writing: what changed, in one script ----------------------------------------------------------------
    async def _write(
        self,
        session: Session,
        *,
        lease: str,
        incarnation: str,
        base: str,
        only: Branch | None = None,
        keep: bool = False,
    ) -> str:
        """Write what changed since Redis last had the session (all of it for a create: ``base`` ''), and let the
        lease go (``keep``: not yet, turns run on other branches here), in one round trip. ``only``: the branch a turn
        ended on; the others are written as Redis has them (a branch with a turn still running here is not written
        half-done, and a new one not at all). Returns the script's answer; the bookkeeping is kept only for 'ok'."""
        session.touch()
        sid = session.session_id
        key = self._keys.session(sid)
        batch = WriteBatch(key, secrets.token_hex(8))
        kept = [b for b in session.branches if only is None or b is only or b.sample.persisted]
        own = [only is None or b is only for b in kept]  # written now; the others as Redis has them
        pending = [
            batch.sample(b.sample) if mine else dict(b.sample.persisted) for b, mine in zip(kept, own, strict=True)
        ]
        written = self._written.get(sid, {}) if base else {}
        fields = {
            name: value
            for name, value in _session_fields(session, kept, pending, own).items()
            if written.get(name) != value
        }
        # A create's keys get their TTL as they are created; later, the whole session's keys and its index score
        # are pushed forward now and then (an APPEND keeps a key's TTL; a PEXPIRE of every key on every write cost
        # more than the turn's own writes).
        refresh = bool(base and self._key_ttl_ms) and (
            time.monotonic() - self._ttl_refreshed.get(sid, 0.0) > self._key_ttl_ms / 10e3
        )
        if self._key_ttl_ms:
            for name in Keys.all(key, _layout(pending)) if refresh else [key, *batch.created]:
                batch.ops.append(("E", name, ""))
        keys = [key, Keys.lease(key), *(stage for stage, _ in batch.staged)]
        where = {name: number for number, name in enumerate(keys, start=1)}
        args: list[Any] = [lease, incarnation, base, batch.stamp, self._deadline_ms(), self._key_ttl_ms]
        args += [len(batch.staged), len(fields), "1" if keep else ""]
        for name, value in fields.items():
            args += (name, value)
        for code, name, value in batch.ops:
            if name not in where:
                keys.append(name)
                where[name] = len(keys)
            args += (code, where[name], where[value] if code == "M" else value)

        def send() -> Awaitable[Any]:
            args[4] = self._deadline_ms()  # each send is fenced by its own deadline
            return self._write_script(self.redis, keys, args, batch.staged, self._wait)

        write = self._patient(send)
        # The index (another slot on a cluster, so maybe another master) is kept beside the script, never part of
        # its commit: a create adds the session, and its score (the sweep's idea of when it was last used) is pushed
        # forward now and then. An index update that fails is retried in the background (``_repair_index``) and
        # never fails the write, which has happened; the sweep checks the session's own time before it deletes.
        index = self._index_soon(sid, session.updated_at) if not base or refresh else None
        try:
            answer, confirmed = await self._commit(write)
        except TRANSIENT as exc:
            answer, confirmed = await self._resolve(sid, key, batch.stamp, send, exc)
        finally:
            if index is not None:
                await index
        if self._wait is not None and answer in ("ok", "done") and confirmed is not None and confirmed < self._wait[0]:
            # Written on its master, which no replica has confirmed yet: it may not survive a failover. Neither an
            # acknowledgement nor "nothing was written".
            raise StoreUnavailable(
                f"session {sid!r}: the write reached Redis, but {confirmed} of the {self._wait[0]} replicas asked "
                f"for confirmed it within {self._wait[1]} ms: it may not survive a failover of its node",
                reason="unconfirmed",
            )
        if answer in ("ok", "done"):
            for branch, done in zip(kept, pending, strict=True):
                branch.sample.persisted = done
            self._cached[sid] = (incarnation, batch.stamp)
            self._written[sid] = written | fields
            if refresh or not base:
                self._ttl_refreshed[sid] = time.monotonic()
        return answer

    async def _commit(self, write: Awaitable[Any]) -> tuple[str, int | None]:
        """A write script's answer, and how many replicas confirmed it (None: not asked)."""
        answer, confirmed = await write if self._wait is not None else (await write, None)
        return (answer.decode() if isinstance(answer, bytes) else str(answer)), confirmed

    async def _resolve(
        self, sid: str, key: str, stamp: str, send: Callable[[], Awaitable[Any]], exc: Exception
    ) -> tuple[str, int | None]:
        """A write whose answer never came (Redis timed out, or went away, with it) may have run. Once Redis answers,
        the session's stamp says which: the write's own (it ran: ``done``; sent once more when replicas must
        confirm it, a resend answering ``done`` and then waiting for them), or not (nothing was written: every attempt
        is past its fence by now, and ``exc`` is raised, a 503 that says so). No answer at all: unknown, said so."""
        try:
            now = await self._patient(lambda: self.redis.hget(key, "stamp"))
        except TRANSIENT:
            raise StoreUnavailable(
                f"session {sid!r}: its write was sent and Redis did not answer ({exc}): whether it was written is "
                "unknown",
                reason="unknown",
            ) from exc
        if now is None or now.decode() != stamp:
            raise exc
        log.info("session %s: a write whose answer was lost had happened", sid)
        if self._wait is None:
            return "done", None
        try:
            return await self._commit(self._patient(send))
        except TRANSIENT:
            return "done", 0  # written, not confirmed: StoreUnavailable unconfirmed

    def _check_written(self, sid: str, answer: str) -> None:
        if answer in ("ok", "done"):
            return
        why = {
            "lease": ("the hold on it ran out before its write", "lease_lost"),
            "stale": ("it changed in Redis under this turn (deleted, or Redis restarted from an older copy)", "stale"),
            "late": ("Redis ran the write too late (it was paused or overloaded): nothing was written", "redis"),
        }.get(answer, (f"Redis answered {answer!r}: nothing was written", "redis"))
        raise StoreUnavailable(f"session {sid!r}: {why[0]}", reason=why[1])

    # ---- the session index: beside the sessions, repaired -----------------------------------------------------
    def _index_soon(self, session_id: str, score: float | None) -> Coroutine[Any, Any, None]:
        """An index update beside a write (``_index_apply``), started now; what it returns, awaited once the write is
        done, waits for it INDEX_WAIT_S at most: a create is listed once it is answered, unless the index's node is
        slow (it then catches up in the background)."""
        return _settled(self._background(self._index_apply(session_id, score), "redis-index"))

    async def _index_apply(self, session_id: str, score: float | None) -> None:
        """The session in the index with a score of at least ``score`` (``ZADD GT``: idempotent, adds a missing entry,
        never moves a score back), or out of it (None). Never raises: when the index's node fails, the update is
        queued for ``_repair_index``."""
        try:
            if score is None:
                await self.redis.zrem(self._keys.index, session_id)
            else:
                await self.redis.zadd(self._keys.index, {session_id: score}, gt=True)
        except (*REDIS_FAILURES, StoreUnavailable) as exc:
            if session_id not in self._index_pending:
                log.warning("session %s: the session index could not be updated (%s); retrying", session_id, exc)
            self._index_pending[session_id] = score
        else:
            if self._index_pending.get(session_id, _NOT_PENDING) == score:
                del self._index_pending[session_id]

    async def _repair_index(self) -> None:
        """Apply the index updates that failed (the latest for each session), until the index's node answers."""
        for session_id, score in list(self._index_pending.items()):
            await self._index_apply(session_id, score)
            if session_id in self._index_pending:
                return  # still unreachable: the rest waits for the next round

    # ---- deleting --------------------------------------------------------------------------------------------
    async def _delete(self, session_id: str, *, idle_before: float | None) -> tuple[str, str | None]:
        """Delete the session unless a turn holds it ('busy', and the holder's instance id) or, with
        ``idle_before``, it was used since ('fresh'); else 'ok' or 'missing'."""
        key = self._keys.session(session_id)
        dead = ""  # the lease of a holder that stopped: it does not keep the session
        with self._errors("delete"):
            for _ in range(READ_ATTEMPTS):
                stamp, samples = await self._patient(lambda: self.redis.hmget(key, "stamp", "samples"))
                if stamp is None:
                    answer = [b"missing"]
                else:
                    keys = [key, Keys.lease(key), *Keys.all(key, orjson.loads(samples))[1:]]
                    args = [stamp, "" if idle_before is None else idle_before, dead]
                    answer = await self._patient(lambda: self._delete_script(self.redis, keys, args))  # noqa: B023
                status = answer[0].decode()
                if status == "changed":
                    continue
                if status in ("ok", "missing"):
                    # The index forgets it too (a session whose keys ran out of their TTL leaves it here), repaired
                    # later when its node fails: the session is deleted either way.
                    await self._index_soon(session_id, None)
                    self._forget(session_id)
                    if status == "ok":
                        self._count = max(0, self._count - 1)
                    return status, None
                if status == "fresh":
                    await self._index_soon(session_id, float(answer[1]))
                    return status, None
                holder = answer[1].decode()
                if not dead and await self._holder_is_dead(holder):
                    dead = holder
                    continue
                return status, holder.split(":")[0]  # busy: who holds it
        raise StoreUnavailable(f"delete: session {session_id!r} kept changing while it was deleted", reason="redis")

    # ---- reading a whole session -----------------------------------------------------------------------------
    async def _load(self, session_id: str) -> Session:
        key = self._keys.session(session_id)
        with self._errors("read"):
            for _ in range(READ_ATTEMPTS):
                fields = {k.decode(): v for k, v in (await self._patient(lambda: self.redis.hgetall(key))).items()}
                if "stamp" not in fields:
                    self._forget(session_id)
                    raise SessionNotFound(f"no session {session_id!r}", session_id=session_id)
                layout = orjson.loads(fields["samples"])
                answers = await self._patient(lambda: self._read_parts(key, layout))  # noqa: B023
                if answers[-1] == fields["stamp"]:
                    break
            else:
                raise StoreUnavailable(f"read: session {session_id!r} kept changing while it was read", reason="redis")
        current = (fields.get("incarnation", b"").decode(), fields["stamp"].decode())
        local = self._sessions.get(session_id)
        if local is not None and self._cached.get(session_id) == current:
            # A concurrent read (a turn's hold, a view) loaded this very version first: keep one copy per version,
            # or the turn would run on a twin that the views never see busy or changed.
            return local
        replies = iter(answers)
        samples = [(sample["id"], _read_sample(sample["id"], sample["chunks"], replies)) for sample in layout]
        session = _session_from_fields(session_id, fields, samples)
        self._register(session)
        self._cached[session_id] = current
        self._written[session_id] = {
            name: value for name, value in fields.items() if name in SESSION_FIELDS or name.startswith(BRANCH_FIELD)
        }
        self._trim_cache()
        return session

    async def _read_parts(self, key: str, layout: list[dict[str, Any]]) -> list[Any]:
        """Every key of the samples ``layout`` lists, in ``_read_sample``'s order, then the hash's stamp (unchanged
        since the hash was read: no write landed in between), in one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for sample in layout:
                pipe.get(Keys.part(key, sample["id"], "meta"))
                for name, chunks in sample["chunks"].items():
                    for number in range(chunks):
                        pipe.get(Keys.chunk(key, sample["id"], name, number))
                pipe.lrange(Keys.part(key, sample["id"], "turns"), 0, -1)
                pipe.get(Keys.part(key, sample["id"], "text"))
            pipe.hget(key, "stamp")
            return await pipe.execute()

    # ---- the local copies ------------------------------------------------------------------------------------
    def _forget(self, session_id: str) -> None:
        session = self._sessions.pop(session_id, None)
        self._cached.pop(session_id, None)
        self._written.pop(session_id, None)
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


class WriteBatch:
    """The operations of one write (the script's (code, key, value) triples), the keys it creates (they need their
    TTL) and the bytes staged beside it (``STAGE_BYTES``)."""

    def __init__(self, session_key: str, stamp: str) -> None:
        self.key = session_key
        self.stamp = stamp
        self.ops: list[tuple[str, str, Any]] = []
        self.created: list[str] = []
        self.staged: list[tuple[str, memoryview]] = []

    def put(self, key: str, payload: memoryview, *, new: bool) -> None:
        """``key`` becomes ``payload``."""
        if len(payload) >= STAGE_BYTES:
            stage = Keys.stage(self.key, self.stamp, len(self.staged))
            self.staged.append((stage, payload))
            self.ops.append(("M", key, stage))  # the script gives the key its TTL
            return
        self.ops.append(("S", key, payload.tobytes()))
        if new:
            self.created.append(key)

    def sample(self, sample: SessionSample) -> dict[str, Any]:
        """Add the writes of what ``sample`` gained since it was last written; returns its bookkeeping after them
        (kept once the write succeeded)."""
        done = dict(sample.persisted) or {"id": secrets.token_hex(6), "arrays": {}, "turns": 0, "text": 0, "meta": b""}
        sample_id = done["id"]
        arrays = dict(done["arrays"])
        for name in ARRAYS:
            buffer: GrowableArray | None = getattr(sample, name)
            if buffer is not None:
                arrays[name] = self.array(sample_id, name, buffer, arrays.get(name))
        turns = sample.turns
        turns_key = Keys.part(self.key, sample_id, "turns")
        if len(turns) < done["turns"]:
            self.ops.append(("D", turns_key, ""))
            done["turns"] = 0
        if len(turns) > done["turns"]:
            if not done["turns"]:  # the list starts here
                self.created.append(turns_key)
            for turn in turns[done["turns"] :]:
                self.ops.append(("R", turns_key, orjson.dumps(turn.to_json())))
        text = sample.response
        text_key = Keys.part(self.key, sample_id, "text")
        if len(text) < done["text"]:
            self.ops.append(("S", text_key, text.encode()))
        elif len(text) > done["text"]:
            self.ops.append(("A", text_key, text[done["text"] :].encode()))
            if not done["text"]:
                self.created.append(text_key)
        meta = orjson.dumps(_sample_meta(sample))
        if meta != done["meta"]:
            self.ops.append(("S", Keys.part(self.key, sample_id, "meta"), meta))
            if not sample.persisted:
                self.created.append(Keys.part(self.key, sample_id, "meta"))
        return {"id": sample_id, "arrays": arrays, "turns": len(turns), "text": len(text), "meta": meta}

    def array(self, sample_id: str, name: str, buffer: GrowableArray, written: list[int] | None) -> list[int]:
        """Write what array ``name`` (``buffer``) gained to its chunks; ``written``, and the result: (generation,
        items, chunks, bytes of the last chunk) as Redis has them. New items are appended to the last chunk, or
        make a new one; earlier items that changed (``GrowableArray.generation``: an upstream that resent all routing
        rows) rewrite the array as one chunk."""
        generation, items = buffer.generation, len(buffer)

        def chunk(number: int) -> str:
            return Keys.chunk(self.key, sample_id, name, number)

        if written is not None and written[0] == generation and written[1] <= items:
            _, before, chunks, last = written
            if before == items:
                return written
            new = _raw(buffer.view()[before:])
            if len(new) < STAGE_BYTES and last + len(new) <= CHUNK_BYTES:
                self.ops.append(("A", chunk(chunks - 1), new.tobytes()))
                return [generation, items, chunks, last + len(new)]
            self.put(chunk(chunks), new, new=True)
            return [generation, items, chunks + 1, len(new)]
        for number in range(1, written[2] if written is not None else 0):
            self.ops.append(("D", chunk(number), ""))
        whole = _raw(buffer.view())
        self.put(chunk(0), whole, new=written is None)
        return [generation, items, 1, len(whole)]


def _layout(pending: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The hash's ``samples``: each sample's id and how many chunks each of its arrays has."""
    return [{"id": p["id"], "chunks": {name: state[2] for name, state in p["arrays"].items()}} for p in pending]


async def _settled(task: asyncio.Task[None]) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(task), INDEX_WAIT_S)


def _raw(array: np.ndarray) -> memoryview:
    """An array's bytes without a copy. redis-py sends a memoryview as it is, but as a write of its own: small ones
    are copied (``tobytes``) into the command's one buffer."""
    return memoryview(np.ascontiguousarray(array).reshape(-1)).cast("B")  # 1-D: a cast refuses an empty (0, L, K)


# ---- the session's hash: its small fields --------------------------------------------------------------------------
SESSION_FIELDS = (
    "samples",
    "metadata",
    "sampling_defaults",
    "limits",
    "resume",
    "created_at",
    "updated_at",
    "summary",
)
# One hash field per branch, "branch:{sample id}": its place in the tree and its chat record (written when it changed:
# a turn rewrites only its own branch's).
BRANCH_FIELD = "branch:"


def _session_fields(
    session: Session, branches: list[Branch], pending: list[dict[str, Any]], own: list[bool]
) -> dict[str, bytes]:
    """The hash's fields (besides incarnation and stamp), each a JSON document or a number: the branches' samples,
    listed in order, and the field of each branch ``own`` marks (the ones written now: a chat record is big)."""
    ids = {id(branch.sample): done["id"] for branch, done in zip(branches, pending, strict=True)}
    fields = {
        "samples": orjson.dumps(_layout(pending)),
        "metadata": orjson.dumps(session.metadata),
        "sampling_defaults": orjson.dumps(session.sampling_defaults),
        "limits": orjson.dumps(session.limits.to_json()),
        "resume": orjson.dumps(session.resume),
        "created_at": repr(session.created_at).encode(),
        "updated_at": repr(session.updated_at).encode(),
        "summary": orjson.dumps(session.listing() | {"busy": False}),
    }
    for branch, done, mine in zip(branches, pending, own, strict=True):
        if mine:
            parent = None if branch.parent is None else ids.get(id(branch.parent.sample))
            record = None if branch.record is None else branch.record.to_json()
            fields[BRANCH_FIELD + done["id"]] = orjson.dumps(
                {"parent": parent, **branch.tree_fields(), "record": record}
            )
    return fields


# A branch field without some of Branch.TREE_FIELDS reads them as these (None where not listed).
_TREE_DEFAULTS: dict[str, Any] = {"fork_token": 0, "created_at": 0.0, "updated_at": 0.0}


def _session_from_fields(
    session_id: str, fields: dict[str, bytes], samples: list[tuple[str, SessionSample]]
) -> Session:
    by_id: dict[str, Branch] = {}
    parents: list[tuple[Branch, str | None]] = []
    for sample_id, sample in samples:
        raw = fields.get(BRANCH_FIELD + sample_id)
        meta = orjson.loads(raw) if raw else {}
        record = meta.get("record")
        branch = Branch(
            sample,
            record=None if record is None else ChatRecord.from_json(record),
            **{name: meta.get(name, _TREE_DEFAULTS.get(name)) for name in Branch.TREE_FIELDS},
        )
        by_id[sample_id] = branch
        parents.append((branch, meta.get("parent")))
    for branch, parent in parents:
        branch.parent = None if parent is None else by_id.get(parent)
    return Session(
        session_id=session_id,
        branches=[by_id[sample_id] for sample_id, _ in samples],
        metadata=orjson.loads(fields["metadata"]),
        sampling_defaults=orjson.loads(fields["sampling_defaults"]),
        resume=orjson.loads(fields.get("resume", b"false")) is True,  # (sessions written before it have none)
        created_at=float(fields["created_at"]),
        updated_at=float(fields["updated_at"]),
        limits=SessionLimits.from_json(orjson.loads(fields["limits"]) if "limits" in fields else None),
        closed="closed" in fields,
    )


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


def _read_sample(sample_id: str, chunks: dict[str, int], replies: Iterator[Any]) -> SessionSample:
    """A sample from the replies to ``_load``'s reads of it, in their order: meta, each array's chunks, turns, text."""
    meta_raw = next(replies)
    meta = orjson.loads(meta_raw)
    moe = None if meta["moe"] is None else MoEShape(*meta["moe"])
    raw = {name: [next(replies) or b"" for _ in range(count)] for name, count in chunks.items()}
    turns, text = next(replies), next(replies) or b""

    def array(name: str) -> GrowableArray | None:
        if name not in raw:
            return None
        parts = raw[name]
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        if name == "routed_experts":
            assert moe is not None
            rows = np.frombuffer(data, dtype=np.dtype(meta["routing_dtype"])).reshape(-1, moe.num_layers, moe.topk)
            return GrowableArray.from_array(rows)
        return GrowableArray.from_array(np.frombuffer(data, dtype=ARRAYS[name]))

    def required(name: str) -> GrowableArray:
        return array(name) or GrowableArray(ARRAYS[name])

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
        name: [buffer.generation, len(buffer), len(parts), len(parts[-1])]
        for name, parts in raw.items()
        if (buffer := getattr(sample, name)) is not None
    }
    sample.persisted = {
        "id": sample_id,
        "arrays": arrays,
        "turns": len(sample.turns),
        "text": len(sample.response),
        "meta": meta_raw,
    }
    return sample
