"""Chaos with real clients, counted: a fleet under steady load while one kind of fault is injected again and again.

The fleet is the deployment's (tests/fleet.py): HAProxy with docker/haproxy.cfg in front of three gateway replicas
on a Redis Cluster of three masters with two replicas each, a turn acknowledged once a Redis replica has it
(GATEWAY_REDIS_WAIT_REPLICAS=1), replicas heartbeating and draining on SIGTERM, an API key. The load, all through
HAProxy:

- **SDK token rollouts** (``slime_client``, as a trainer runs them): each creates a session and runs turns that mix
  unary turns answered with their tensors, streamed turns and tool-token appends, every one with ``sync`` (what the
  rollout believes the session holds), keeping its own copy of every token it was answered; a failure the SDK did not
  ride out is retried by the rollout, as slime does, and a ``session_mismatch`` is classified: the session holds fewer
  tokens than acknowledged (a **lost** turn), or more (a turn committed whose answer never arrived: an **orphan**,
  discarded as slime does by starting the sample's session again). At the end the session's sample must equal the
  rollout's copy, token for token: tokens, loss mask, and the log-probs of the turns answered with tensors.
- **Real harness runs**, Claude Code and Codex from ``.harnesses/`` (as tests/test_harnesses.py runs them), each
  against a session of its own with scripted model answers (a tool call, then a final answer); a run is complete when
  the harness exits 0 with the final answer after really running the tool, and exact when its session is the
  template's token-exact rendering of the conversation in one branch (``chat_checks.check_trajectory``). Scripted
  answers are queued per turn position (rid ``{session}-{2k}-``), several times each, so that a turn the harness
  sends again (after a replica died with it) gets the same answer.

The faults: ``kill`` (kill -9 of a replica, started again), ``rolling`` (every replica in turn: SIGTERM, drain,
start), ``failover`` (a Redis master kill -9'd, its replica promoted, the old master back as a replica), ``pause``
(a Redis master SIGSTOPped past the cluster's node timeout, so it is failed over, then SIGCONTed), and ``none``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from chat_checks import full_view, hermes_call, render_ids, session_sample, template_messages
from conftest import Service, run_simulator
from fleet import Cluster, HAProxy, Replica, haproxy, redis_cluster
from procs import free_port

from slime_client import GatewayClient, Session
from slime_client.errors import ConflictError, GatewayError, GatewayStatusError, NotFoundError
from slime_client.types import SessionSync

KEY = "harness-test-key"  # the key tests/test_harnesses.py gives Claude Code and Codex
AUTH = {"Authorization": f"Bearer {KEY}"}
SYNC_TOKENS = 16
FAULTS = ("none", "kill", "rolling", "failover", "pause")
SCRIPT_REPEATS = 6  # each scripted answer is queued this many times at its position: resent turns get it again


def fleet_env(url: str) -> dict[str, str]:
    return {
        "GATEWAY_STORE": url,
        "GATEWAY_REDIS_PREFIX": f"chaos-{uuid.uuid4().hex[:6]}",
        "GATEWAY_REDIS_WAIT_REPLICAS": "1",
        "GATEWAY_REDIS_WAIT_TIMEOUT_MS": "3000",
        "GATEWAY_REDIS_HEARTBEAT_S": "1",
        "GATEWAY_REDIS_RETRY_S": "20",
        "GATEWAY_DRAIN_S": "2",
        "GATEWAY_API_KEY": KEY,
        "GATEWAY_CHAT_CONTEXT_TOKENS": "262144",
        "GATEWAY_LOG_LEVEL": "info",
    }


@dataclass
class ChaosFleet:
    sim: Service
    cluster: Cluster
    replicas: list[Replica]
    proxy: HAProxy
    directory: Path

    @property
    def url(self) -> str:
        return self.proxy.url


@contextmanager
def chaos_fleet(directory: Path, tokenizer_dir: Path) -> Iterator[ChaosFleet]:
    with ExitStack() as stack:
        # Tokens 5 ms apart: a turn lasts long enough for faults to land in its middle.
        sim = stack.enter_context(run_simulator("--tokenizer", str(tokenizer_dir), "--token-delay-ms", "5"))
        cluster = stack.enter_context(redis_cluster(directory / "cluster", replicas=2))
        env = fleet_env(cluster.url)
        args = ("--upstream-url", sim.url, "--tokenizer", str(tokenizer_dir))
        replicas = [Replica(f"gw{n}", free_port(), args, env, log_dir=directory / "logs") for n in (1, 2, 3)]
        for replica in replicas:
            stack.callback(replica.stop)
        with ThreadPoolExecutor(len(replicas)) as pool:  # each loads the tokenizer: seconds
            list(pool.map(Replica.start, replicas))
        proxy = stack.enter_context(haproxy(replicas, directory))
        yield ChaosFleet(sim, cluster, replicas, proxy, directory)


# ---- the tally -----------------------------------------------------------------------------------------------------
@dataclass
class Tally:
    fault: str
    seconds: float = 0.0
    faults: int = 0  # faults injected
    rollouts: int = 0  # SDK rollouts completed and checked exact
    rollouts_unfinished: int = 0  # given up (a client-visible error past the rollout's own retries)
    turns_acknowledged: int = 0  # SDK turns and appends answered to the client
    lost: int = 0  # acknowledged, then missing from the session
    duplicated: int = 0  # in the session twice, or a harness session forked by a resent turn
    half_written: int = 0  # a session whose arrays disagree with what its client was answered
    orphans: int = 0  # committed but never answered (the client was told to retry): discarded, as slime does
    harness: Counter[str] = field(default_factory=Counter)  # "claude complete", "codex failed", ...
    harness_exact: int = 0
    errors: Counter[str] = field(default_factory=Counter)  # client-visible errors, by kind
    notes: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def error(self, kind: str) -> None:
        with self.lock:
            self.errors[kind] += 1

    def note(self, text: str) -> None:
        with self.lock:
            if len(self.notes) < 50:
                self.notes.append(text)

    @property
    def harness_runs(self) -> int:
        return sum(self.harness.values())

    def row(self) -> str:
        """A Markdown table row: fault | runs completed | lost | duplicated | half-written | errors by kind."""
        runs = ", ".join(f"{name} {count}" for name, count in sorted(self.harness.items())) or "none"
        errors = ", ".join(f"{kind} {count}" for kind, count in self.errors.most_common()) or "none"
        return (
            f"| {self.fault} | {self.faults} | {self.seconds:.0f} s | {self.rollouts} rollouts "
            f"({self.turns_acknowledged} turns), {self.rollouts_unfinished} unfinished | {runs} "
            f"({self.harness_exact} exact) | {self.lost} | {self.duplicated} | {self.half_written} | {self.orphans} "
            f"| {errors} |"
        )


TABLE_HEAD = (
    "| fault | faults injected | load | SDK rollouts (exact) | harness runs | turns lost | duplicated | half-written "
    "| orphans (discarded) | client-visible errors by kind |\n|---|---|---|---|---|---|---|---|---|---|"
)


def error_kind(exc: BaseException) -> str:
    if isinstance(exc, GatewayStatusError):
        reason = exc.details.get("reason")
        return f"{exc.status} {exc.error_type}" + (f" ({reason})" if reason else "")
    return type(exc).__name__


# ---- SDK rollouts --------------------------------------------------------------------------------------------------
@dataclass
class Copy:
    """What a rollout was answered: the session's tokens as it believes them, its loss mask and known log-probs."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)

    def sync(self) -> SessionSync:
        return SessionSync(len(self.tokens), tuple(self.tokens[-SYNC_TOKENS:]))

    def add(self, ids: list[int], *, trained: bool, log_probs: list[float] | None = None) -> None:
        self.tokens += ids
        self.mask += [1 if trained else 0] * len(ids)
        self.log_probs += list(log_probs) if log_probs is not None else [None if trained else 0.0] * len(ids)


class Orphan(Exception):
    """The session holds more than the rollout was answered: a turn committed whose answer was lost."""


class Lost(Exception):
    """The session holds fewer tokens than the rollout was answered."""


async def sdk_rollout(gw: GatewayClient, tally: Tally, rng: random.Random, turns: int = 6) -> None:
    sid = f"chaos-sdk-{uuid.uuid4().hex[:12]}"
    copy = Copy([rng.randrange(5, 500) for _ in range(rng.randrange(8, 24))])
    session = await create_with_retries(gw, sid, copy, tally)
    try:
        for _ in range(turns):
            await one_turn(session, copy, tally, rng)
    except Orphan:
        tally.add(orphans=1)
        await verify(session, copy, tally, prefix_only=True)
        return
    except Lost as exc:
        tally.add(lost=1)
        tally.note(f"{sid}: {exc}")
        return
    except GatewayError as exc:
        tally.add(rollouts_unfinished=1)
        tally.note(f"{sid}: gave up: {exc}")
        return
    await verify(session, copy, tally)


async def create_with_retries(gw: GatewayClient, sid: str, copy: Copy, tally: Tally) -> Session:
    for _ in range(20):
        try:
            return await gw.create_session(prompt_ids=copy.prompt, session_id=sid)
        except ConflictError as exc:
            if exc.error_type == "session_exists":  # an earlier attempt made it (its answer was lost)
                return Session(gw, sid)
            raise
        except GatewayError as exc:
            tally.error(f"create: {error_kind(exc)}")
            await asyncio.sleep(0.5)
    raise RuntimeError(f"could not create {sid}")


async def one_turn(session: Session, copy: Copy, tally: Tally, rng: random.Random) -> None:
    """One turn or append, resent (with sync) until it is answered; classifies a session that is not as expected."""
    kind = rng.choice(["tensors", "tensors", "stream", "append"])
    params = {"max_new_tokens": rng.randrange(4, 24)}
    mismatches = 0
    for _ in range(30):
        try:
            if kind == "tensors":
                turn = await session.generate_turn(params, sync=copy.sync())
                copy.add(turn.tokens.tolist(), trained=True, log_probs=turn.rollout_log_probs.tolist())
            elif kind == "stream":
                async with session.generate(params, sync=copy.sync(), stream=True) as stream:
                    async for _ in stream:
                        pass
                assert stream.result is not None
                copy.add(stream.result.new_token_ids, trained=True)
            else:
                ids = [rng.randrange(5, 500) for _ in range(3)]
                await session.append(ids, sync=copy.sync())
                copy.add(ids, trained=False)
            tally.add(turns_acknowledged=1)
            return
        except ConflictError as exc:
            if exc.error_type != "session_mismatch":
                tally.error(f"{kind}: {error_kind(exc)}")
                await asyncio.sleep(0.5)
                continue
            held = int(exc.details["total_tokens"])
            if held > len(copy.tokens):
                raise Orphan() from exc
            mismatches += 1
            if mismatches < STALE_READ_CHECKS:
                # A Redis master frozen and failed over answers with its old data until it learns of its demotion:
                # a session that looks shorter than acknowledged is read again before it counts as a loss.
                tally.error("409 session_mismatch: fewer tokens than acknowledged (a stale read), sent again")
                await asyncio.sleep(1.0)
                continue
            raise Lost(f"the session holds {held} tokens, the rollout was answered {len(copy.tokens)}") from exc
        except NotFoundError as exc:
            raise Lost("the session is gone") from exc
        except GatewayError as exc:
            tally.error(f"{kind}: {error_kind(exc)}")
            await asyncio.sleep(0.2)
    raise GatewayStatusError("the turn never went through", status=0)


async def verify(session: Session, copy: Copy, tally: Tally, *, prefix_only: bool = False) -> None:
    """The session's sample against the rollout's copy, token for token (``prefix_only``: the copy must be a
    prefix, the rest is an orphan turn). A read that disagrees is read again a few times first: a Redis master frozen
    and failed over answers with its old data until it learns of its demotion."""
    first = ""
    for attempt in range(STALE_READ_CHECKS):
        outcome = await compare(session, copy, tally, prefix_only=prefix_only)
        if outcome == "exact":
            if attempt:
                tally.error("a stale read, exact when read again")
                tally.note(f"{session.session_id}: read {first} first, exact when read again")
            if not prefix_only:
                tally.add(rollouts=1)
            await delete_quietly(session)
            return
        if outcome == "unread":
            tally.add(rollouts_unfinished=1)
            return
        first = first or outcome
        await asyncio.sleep(1.0)
    tally.add(**{outcome: 1})
    tally.note(f"{session.session_id}: {outcome}: the session is not what its client was answered")


async def compare(session: Session, copy: Copy, tally: Tally, *, prefix_only: bool) -> str:
    """exact, lost, duplicated, half_written, or unread."""
    for _ in range(30):
        try:
            sample = await session.fetch()
            break
        except GatewayError as exc:
            tally.error(f"fetch: {error_kind(exc)}")
            await asyncio.sleep(0.5)
    else:
        return "unread"
    tokens = sample.tokens.tolist()
    mask = sample.loss_mask.tolist()
    log_probs = sample.rollout_log_probs.tolist()
    n = len(copy.tokens)
    if prefix_only:
        tokens, mask, log_probs = tokens[:n], mask[: n - len(copy.prompt)], log_probs[: n - len(copy.prompt)]
    exact = tokens == copy.tokens and mask == copy.mask and len(log_probs) == len(copy.log_probs)
    exact = exact and all(known is None or known == got for known, got in zip(copy.log_probs, log_probs, strict=True))
    if exact:
        return "exact"
    if len(tokens) < n:
        return "lost"
    return "duplicated" if len(tokens) > n else "half_written"


async def delete_quietly(session: Session) -> None:
    with contextlib.suppress(GatewayError):  # else the idle sweep takes it
        await session.delete()


def rollout_workers(url: str, tally: Tally, stop: threading.Event, workers: int, seed: int) -> threading.Thread:
    """``workers`` rollouts at a time until ``stop``, on an event loop in a thread of their own."""

    async def worker(gw: GatewayClient, rng: random.Random) -> None:
        while not stop.is_set():
            await sdk_rollout(gw, tally, rng)

    async def main() -> None:
        async with GatewayClient(url, api_key=KEY, timeout=120) as gw:
            await asyncio.gather(*(worker(gw, random.Random(seed + n)) for n in range(workers)))

    thread = threading.Thread(target=asyncio.run, args=(main(),), name="sdk-rollouts", daemon=True)
    thread.start()
    return thread


# ---- real harness runs ---------------------------------------------------------------------------------------------
def script_positions(sim: Service, sid: str, answers: list[str]) -> None:
    """Each answer at its turn position on branch 0 (the k-th model turn: rid ``{sid}-{2k}-...``, a chat turn's
    messages and its answer being two entries of the turn log), SCRIPT_REPEATS times."""
    for k, text in enumerate(answers):
        body = {"rid_prefix": f"{sid}-{2 * k}-", "answers": [{"text": text}] * SCRIPT_REPEATS}
        httpx.post(f"{sim.url}/sim/script", json=body, timeout=30).raise_for_status()


def new_chat_session(url: str) -> str:
    sid = f"chaos-{uuid.uuid4().hex[:12]}"
    for _ in range(60):
        try:
            made = httpx.post(f"{url}/v1/sessions", json={"session_id": sid}, headers=AUTH, timeout=30)
        except httpx.HTTPError:
            time.sleep(0.5)
            continue
        if made.status_code == 201 or made.json()["error"]["type"] == "session_exists":
            return sid
        time.sleep(0.5)
    raise RuntimeError("could not create a chat session")


def harness_run(fleet: ChaosFleet, tally: Tally, which: str, tokenizer: Any, number: int) -> None:
    import test_harnesses as h  # the harnesses' command lines and environments, as tests/test_harnesses.py runs them

    gateway = Service(fleet.url, fleet.proxy.port)
    sid = new_chat_session(fleet.url)
    word = f"chaos-{number}"
    if which == "claude":
        call = hermes_call("Bash", {"command": f"echo {word}", "description": "Print the word"})
    else:
        call = hermes_call("exec_command", {"cmd": f"echo {word}"})
    first, final = f"Let me run it.\n{call}", f"It printed {word}."
    script_positions(fleet.sim, sid, [first, final])
    home = fleet.directory / "runs" / f"{which}-{number}-{uuid.uuid4().hex[:6]}"
    home.mkdir(parents=True)
    started = time.monotonic()
    try:
        if which == "claude":
            code, events = h.run_claude(gateway, sid, f"Run echo {word}", home)
            answer = next((e.get("result") for e in events if e.get("type") == "result"), None)
        else:
            code, events = h.run_codex(gateway, sid, f"Run echo {word}", home)
            messages = h.codex_items(events, "agent_message")
            answer = messages[-1]["text"] if messages else None
    except Exception as exc:  # a harness that hung past its timeout
        tally.add(harness=Counter({f"{which} failed": 1}))
        tally.error(f"{which}: {type(exc).__name__}")
        return
    complete = code == 0 and answer == final
    tally.add(harness=Counter({f"{which} {'complete' if complete else 'failed'}": 1}))
    if not complete:
        tally.error(f"{which}: exit {code}" if code else f"{which}: wrong answer")
        tally.note(f"{which} {sid}: exit {code}, answer {answer!r}, {time.monotonic() - started:.1f}s")
    check_session(fleet, tally, which, sid, tokenizer, [first, final] if complete else None, word)


def check_session(
    fleet: ChaosFleet, tally: Tally, which: str, sid: str, tokenizer: Any, answers: list[str] | None, word: str
) -> None:
    """A complete run's session: one branch, token-exact, the tool's output recorded. Any run's: its branch 0 is
    token-exact for the answers it recorded (nothing half-written)."""
    view = None
    for _ in range(30):
        try:
            view = httpx.get(f"{fleet.url}/v1/sessions/{sid}", params={"full": "true"}, headers=AUTH, timeout=30)
            if view.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    if view is None or view.status_code != 200:
        tally.note(f"{which} {sid}: its session could not be read")
        tally.add(lost=1)
        return
    data = view.json()
    chat = data.get("chat") or {}
    recorded = [m for m in (chat.get("record") or {}).get("messages", []) if m["role"] == "assistant"]
    for attempt in range(STALE_READ_CHECKS):
        try:
            check_run(fleet, tally, which, sid, tokenizer, answers, word, data, recorded)
        except AssertionError as exc:
            if attempt + 1 == STALE_READ_CHECKS:
                tally.add(half_written=1)
                shape = [(b["branch"], b["turns"], b.get("cause")) for b in data["branches"]]
                roles = [m["role"] for m in (chat.get("record") or {}).get("messages", [])]
                tally.note(f"{which} {sid}: not token-exact: {str(exc)[:300]}; branches {shape}; record {roles}")
                return
            # A Redis master that was frozen and failed over answers with its old data until it learns of its
            # demotion: a read then may be stale. Read again once the cluster settled.
            time.sleep(1.0)
            data = httpx.get(f"{fleet.url}/v1/sessions/{sid}", params={"full": "true"}, headers=AUTH, timeout=30).json()
            chat = data.get("chat") or {}
            recorded = [m for m in (chat.get("record") or {}).get("messages", []) if m["role"] == "assistant"]
            continue
        if attempt:
            tally.error("a stale read, exact when read again")
            tally.note(f"{which} {sid}: not exact when first read, exact when read again")
        return


STALE_READ_CHECKS = 5


def check_run(
    fleet: ChaosFleet,
    tally: Tally,
    which: str,
    sid: str,
    tokenizer: Any,
    answers: list[str] | None,
    word: str,
    data: dict[str, Any],
    recorded: list[dict[str, Any]],
) -> None:
    """``check_session``'s checks on one read of the session; AssertionError when it is not token-exact."""
    branches = len(data["branches"])
    chat = data.get("chat") or {}
    if answers is None:  # a failed run: whatever it recorded is exact
        if recorded:
            check_partial(fleet, sid, tokenizer, len(recorded), word, which)
        return
    kept = check_recorded(fleet.url, sid, tokenizer, answers)
    if kept:
        tally.error(f"{which}: resent the text of a failed answer as its own history")
    if branches != 1:
        tally.add(duplicated=1)
        tally.note(f"{which} {sid}: {branches} branches (a turn committed twice)")
        return
    results = [m["content"] for m in chat["record"]["messages"] if m["role"] == "tool"]
    if not any(word in r for r in results):
        tally.add(half_written=1)
        tally.note(f"{which} {sid}: the tool's output is not in the record")
        return
    tally.add(harness_exact=1)


def check_partial(fleet: ChaosFleet, sid: str, tokenizer: Any, assistant_turns: int, word: str, which: str) -> None:
    """A failed run's session holds the first scripted answers it got to, token-exact."""
    if which == "claude":
        call = hermes_call("Bash", {"command": f"echo {word}", "description": "Print the word"})
    else:
        call = hermes_call("exec_command", {"cmd": f"echo {word}"})
    check_recorded(fleet.url, sid, tokenizer, [f"Let me run it.\n{call}", f"It printed {word}."], prefix=True)


def check_recorded(url: str, sid: str, tokenizer: Any, scripted: list[str], *, prefix: bool = False) -> int:
    """``chat_checks.check_trajectory`` for a conversation a harness may have edited: branch 0's tokens are the
    template's one-shot rendering of its recorded conversation; the messages the model wrote (the record's ``ends``)
    are the ``scripted`` answers in order (with ``prefix``: the first of them), each where the template puts it, and
    the loss mask is 1 exactly on them. Assistant messages the harness sent as history without the model writing
    them here (the text of an answer whose stream failed, which a harness may keep) are rendered, not trained: how
    many, returned."""
    view = full_view(url, sid, AUTH)
    record = view["chat"]["record"]
    messages, tools = template_messages(record)
    arrays = session_sample(url, sid, AUTH)
    tokens, mask = arrays["tokens"].tolist(), arrays["loss_mask"]
    eos = tokenizer.eos_token_id
    expected = render_ids(tokenizer, messages, tools, prompt=False)
    assert tokens[-1] == eos and tokens == expected[: len(tokens)] and len(expected) == len(tokens) + 1, (
        "the session's tokens are not the template's one-shot rendering of the recorded conversation"
    )
    pairs = list(zip(record["messages"], record["ends"], strict=True))
    model = [i for i, (m, end) in enumerate(pairs) if m["role"] == "assistant" and end is not None]
    rendered = sum(1 for m, end in pairs if m["role"] == "assistant" and end is None)
    answers = scripted[: len(model)] if prefix else scripted
    assert len(model) == len(answers), f"{len(model)} answers written by the model, {len(answers)} scripted"
    trained = np.zeros(len(tokens), dtype=bool)
    for index, text in zip(model, answers, strict=True):
        start = len(render_ids(tokenizer, messages[:index], tools, prompt=True))
        ids = [*tokenizer.encode(text, add_special_tokens=False), eos]
        assert tokens[start : start + len(ids)] == ids, f"assistant message {index} is not the model's tokens"
        trained[start : start + len(ids)] = True
    np.testing.assert_array_equal(mask.astype(bool), trained[view["prompt_length"] :])
    return rendered


def harness_workers(
    fleet: ChaosFleet, tally: Tally, stop: threading.Event, tokenizer: Any, kinds: list[str]
) -> list[threading.Thread]:
    """One thread per entry of ``kinds`` ("claude", "codex", or "both": alternating), running harnesses until stop."""
    counter = iter(range(1_000_000))
    lock = threading.Lock()

    def loop(kind: str) -> None:
        turn = 0
        while not stop.is_set():
            which = kind if kind != "both" else ("claude", "codex")[turn % 2]
            turn += 1
            with lock:
                number = next(counter)
            harness_run(fleet, tally, which, tokenizer, number)

    threads = [threading.Thread(target=loop, args=(kind,), name=f"harness-{kind}", daemon=True) for kind in kinds]
    for thread in threads:
        thread.start()
    return threads


# ---- faults --------------------------------------------------------------------------------------------------------
def inject(fleet: ChaosFleet, fault: str, tally: Tally, stop: threading.Event, rng: random.Random) -> None:
    """Inject ``fault`` again and again until ``stop``, leaving the fleet whole after each (a fault the fleet did not
    recover from in time is noted, and the next one waits for it)."""
    step: Callable[[], None] = {
        "none": lambda: None,
        "kill": lambda: kill_a_replica(fleet, rng),
        "rolling": lambda: rolling_restart(fleet),
        "failover": lambda: fail_a_master_over(fleet, rng, kill=True),
        "pause": lambda: fail_a_master_over(fleet, rng, kill=False),
    }[fault]
    pause_s = {"none": 1.0, "kill": 6.0, "rolling": 2.0, "failover": 6.0, "pause": 6.0}[fault]
    stop.wait(3.0)  # the load is under way
    while not stop.is_set():
        try:
            step()
        except RuntimeError as exc:
            tally.note(f"{fault}: the fleet was slow to recover: {exc}")
            wait_for_replicas(fleet.cluster, timeout_s=300)
        if fault != "none":
            tally.add(faults=1)
        stop.wait(pause_s)


def kill_a_replica(fleet: ChaosFleet, rng: random.Random) -> None:
    replica = rng.choice(fleet.replicas)
    replica.kill()
    time.sleep(2.0)
    replica.start()
    fleet.proxy.wait_for({replica.name: "UP"}, timeout_s=60)


def rolling_restart(fleet: ChaosFleet) -> None:
    for replica in fleet.replicas:
        replica.terminate()
        replica.start()
        fleet.proxy.wait_for({replica.name: "UP"}, timeout_s=60)


def fail_a_master_over(fleet: ChaosFleet, rng: random.Random, *, kill: bool) -> None:
    """A master lost (kill -9) or frozen (SIGSTOP for past the node timeout): one of its replicas is promoted; then
    the old master is back (restarted, or SIGCONTed) as a replica, and the cluster whole before the next fault."""
    cluster = fleet.cluster
    with cluster.client() as client:
        masters = [int(node.port) for node in client.get_primaries()]
    master = cluster.node_on(rng.choice(masters))
    with master.client() as client:
        info = client.info("replication")
    replicas = [cluster.node_on(int(info[f"slave{n}"]["port"])) for n in range(info.get("connected_slaves", 0))]
    if kill:
        master.kill()
    else:
        master.pause()
    deadline = time.monotonic() + 60
    while not any(is_master(node) for node in replicas):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no replica of {master.port} was promoted")
        time.sleep(0.1)
    if kill:
        master.start()
    else:
        master.resume()
    cluster.wait_until_ok()
    wait_for_replicas(cluster)


def is_master(node: Any) -> bool:
    try:
        with node.client(socket_timeout=1) as client:
            return bool(client.info("replication")["role"] == "master")
    except Exception:
        return False


def wait_for_replicas(cluster: Cluster, timeout_s: float = 120.0) -> None:
    """Until every master has two replicas online again."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready = True
        try:
            with cluster.client() as client:  # the masters that serve slots (not one that lost its slots)
                masters = [cluster.node_on(int(node.port)) for node in client.get_primaries()]
            for node in masters:
                with node.client(socket_timeout=1) as client:
                    info = client.info("replication")
                online = [info[f"slave{n}"] for n in range(info.get("connected_slaves", 0))]
                ready = ready and sum(r["state"] == "online" for r in online) >= 2
        except Exception:
            ready = False
        if ready:
            return
        time.sleep(0.2)
    raise RuntimeError("the cluster's replicas did not come back")


# ---- one run -------------------------------------------------------------------------------------------------------
def run_chaos(
    fleet: ChaosFleet,
    fault: str,
    seconds: float,
    tokenizer: Any,
    *,
    rollout_concurrency: int = 4,
    harnesses: list[str] | None = None,
    seed: int = 0,
) -> Tally:
    """``seconds`` of load with ``fault`` injected throughout; the tally once every client has finished."""
    tally = Tally(fault)
    stop = threading.Event()
    rng = random.Random(seed)
    started = time.monotonic()
    sdk = rollout_workers(fleet.url, tally, stop, rollout_concurrency, seed)
    runners = harness_workers(fleet, tally, stop, tokenizer, harnesses if harnesses is not None else ["both"])
    injector = threading.Thread(target=inject, args=(fleet, fault, tally, stop, rng), name="faults", daemon=True)
    injector.start()
    stop.wait(seconds)
    stop.set()
    injector.join(300)
    sdk.join(600)
    for runner in runners:
        runner.join(600)
    tally.seconds = time.monotonic() - started
    logging.getLogger("chaos").info("%s", tally.row())
    return tally


def chaos_seconds(default: float) -> float:
    return float(os.environ.get("CHAOS_SECONDS", default))
