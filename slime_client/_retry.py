"""When the SDK may send a request again, and how long it waits first: small pure functions over constants.

The rule: retry only what cannot have changed a session twice, for as long as a failover takes (a replica's death
behind a load balancer, a Redis Cluster promoting a replica: seconds), within ``max_retries`` and ``retry_for_s``.
The transport (``slime_wire.http1``) says on which side of that line a failure falls: its errors are either
``NotSent`` or ``SentError`` (``slime_wire.errors``).
- Any request may be retried when it never left this process (``NotSent``: the connection could not be made or
  timed out connecting, no connection slot came free in time, or the gateway closed a connection before the
  request reached it), or when the gateway answered 503 (SGLang or the session store unreachable or overloaded: the
  gateway leaves a failed turn's session exactly as it was, so sending the turn again cannot double it; the 503s
  that may have written, ``reason`` ``unconfirmed`` or ``unknown``, are retried only as resendable requests below).
- Only idempotent requests (reads, DELETE) are also retried after the request may have arrived (``SentError``: the
  call's deadline passed, the connection broke, the answer was not valid HTTP), and after 502 and 504.
- A resendable request (a turn or append that carries ``sync``: the gateway refuses to run it on a session that is
  not what the caller believes, 409 ``session_mismatch``) is also re-sent when not a byte of an answer came
  (``NoAnswer``: the replica died with it, or a load balancer closed the connection for it) and after a load
  balancer's own 502 (no gateway answered), and after a 503 that may have written. Without ``sync`` a model turn that
  may have run is never resubmitted: the gateway may have folded it, and a second copy would add a second turn.
- A retry answered 409 ``session_busy`` is retried too: the session is held by the earlier attempt (still running, or
  held by a replica that died with it until another replica takes the hold over), and nothing ran. So is a resendable
  request's first attempt (the session may be held by the caller's own previous request that failed, on a replica
  that died with it; once the session is free its ``sync`` is checked again). Otherwise a first attempt's 409 is the
  caller's own concurrent use and is raised at once.
- The wait is the gateway's ``Retry-After`` when it sends one, else exponential backoff with jitter.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

from slime_wire.errors import NoAnswer, NotSent, SentError, TransportError

INITIAL_RETRY_DELAY_S = 0.25
MAX_RETRY_DELAY_S = 4.0
# A Retry-After past this is not waited for as such (the backoff's delay is used instead).
MAX_RETRY_AFTER_S = 60.0
# Each delay is shortened by up to this fraction at random, so many rollout workers that failed together
# (a gateway restart) do not come back in lockstep.
JITTER_FRACTION = 0.25

# Failures where the request was certainly not sent, so any method may be retried.
NOT_SENT_ERRORS: tuple[type[TransportError], ...] = (NotSent,)
# Failures after which the request may or may not have arrived (the deadline passed, the connection broke, the
# answer was not valid HTTP): only idempotent requests are sent again.
MAYBE_SENT_ERRORS: tuple[type[TransportError], ...] = (SentError,)
# Failures after which a resendable request (one the gateway checks with ``sync``) is sent again.
RESENDABLE_ERRORS: tuple[type[TransportError], ...] = (NoAnswer,)
# Statuses after which the gateway guarantees the session is unchanged and the request may be sent again.
RETRY_STATUSES_ANY = frozenset({503})
# Statuses where the request may have had an effect: only idempotent requests are sent again.
RETRY_STATUSES_IDEMPOTENT = frozenset({502, 503, 504})
# The gateway's 503 ``store_unavailable`` reasons that mean the write may have happened (its store's replicas did not
# confirm it, or Redis never answered it): like a turn that may have run.
MAYBE_WRITTEN = frozenset({"unconfirmed", "unknown"})


def retry_delay(attempt: int, *, rand: Callable[[], float] = random.random, retry_after: float | None = None) -> float:
    """Seconds to wait before retry number ``attempt`` (0-based): the gateway's ``Retry-After`` when it gave one,
    else exponential, capped, with jitter."""
    if retry_after is not None and 0 <= retry_after <= MAX_RETRY_AFTER_S:
        return retry_after
    base = min(MAX_RETRY_DELAY_S, INITIAL_RETRY_DELAY_S * 2**attempt)
    return base * (1.0 - JITTER_FRACTION * rand())


def retryable_error(exc: TransportError, *, idempotent: bool, resendable: bool = False) -> bool:
    """May a request that failed with ``exc`` (no HTTP answer) be sent again?"""
    if isinstance(exc, NOT_SENT_ERRORS):
        return True
    if idempotent:
        return isinstance(exc, MAYBE_SENT_ERRORS)
    return resendable and isinstance(exc, RESENDABLE_ERRORS)


def retryable_status(
    status: int,
    *,
    idempotent: bool,
    resendable: bool = False,
    retrying: bool = False,
    error_type: str | None = None,
    reason: str | None = None,
) -> bool:
    """May a request answered with ``status`` be sent again? ``error_type`` and ``reason``: the gateway's error body
    (``error_type`` None: not a gateway's answer, a proxy's); ``retrying``: an earlier attempt may have arrived."""
    if status == 503 and reason in MAYBE_WRITTEN:  # written, maybe: like a turn that may have run
        return idempotent or resendable
    if status == 409:
        return (retrying or resendable) and error_type == "session_busy"
    if status == 502 and error_type is None and resendable:  # a load balancer's: no gateway answered
        return True
    return status in (RETRY_STATUSES_IDEMPOTENT if idempotent else RETRY_STATUSES_ANY)


def retry_after(headers: Mapping[str, str]) -> float | None:
    """The answer's ``Retry-After`` in seconds (RFC 9110 section 10.2.3; its HTTP-date form is not used here)."""
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if seconds >= 0 else None


def may_have_arrived(exc: TransportError) -> bool:
    """True when the request may have reached the gateway before ``exc`` (so a retry may see its effect)."""
    return not isinstance(exc, NOT_SENT_ERRORS)
