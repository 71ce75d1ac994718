"""When the SDK may send a request again, and how long it waits first: small pure functions over constants.

The rule: retry only what cannot have changed a session twice. The transport (``slime_wire.http1``) says on which
side of that line a failure falls: its errors are either ``NotSent`` or ``SentError`` (``slime_wire.errors``).
- Any request may be retried when it never left this process (``NotSent``: the connection could not be made or
  timed out connecting, no connection slot came free in time, or the gateway closed a connection before the
  request reached it), or when the gateway answered 503 (SGLang unreachable/overloaded: the gateway leaves a
  failed turn's session exactly as it was, so sending the turn again cannot double it).
- Only idempotent requests (reads, DELETE) are also retried after the request may have arrived (``SentError``: the
  call's deadline passed, the connection broke, the answer was not valid HTTP), and after 502 and 504. A model turn
  (``.../generate``) or a tool append that may have run is never resubmitted: the gateway may still fold it, and a
  second copy would add a second turn.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from slime_wire.errors import NotSent, SentError, TransportError

INITIAL_RETRY_DELAY_S = 0.25
MAX_RETRY_DELAY_S = 4.0
# Each delay is shortened by up to this fraction at random, so many rollout workers that failed together
# (a gateway restart) do not come back in lockstep.
JITTER_FRACTION = 0.25

# Failures where the request was certainly not sent, so any method may be retried.
NOT_SENT_ERRORS: tuple[type[TransportError], ...] = (NotSent,)
# Failures after which the request may or may not have arrived (the deadline passed, the connection broke, the
# answer was not valid HTTP): only idempotent requests are sent again.
MAYBE_SENT_ERRORS: tuple[type[TransportError], ...] = (SentError,)
# Statuses after which the gateway guarantees the session is unchanged and the request may be sent again.
RETRY_STATUSES_ANY = frozenset({503})
# Statuses where the request may have had an effect: only idempotent requests are sent again.
RETRY_STATUSES_IDEMPOTENT = frozenset({502, 503, 504})


def retry_delay(attempt: int, *, rand: Callable[[], float] = random.random) -> float:
    """Seconds to wait before retry number ``attempt`` (0-based): exponential, capped, with jitter."""
    base = min(MAX_RETRY_DELAY_S, INITIAL_RETRY_DELAY_S * 2**attempt)
    return base * (1.0 - JITTER_FRACTION * rand())


def retryable_error(exc: TransportError, *, idempotent: bool) -> bool:
    """May a request that failed with ``exc`` (no HTTP answer) be sent again?"""
    if isinstance(exc, NOT_SENT_ERRORS):
        return True
    return idempotent and isinstance(exc, MAYBE_SENT_ERRORS)


def retryable_status(status: int, *, idempotent: bool) -> bool:
    """May a request answered with ``status`` be sent again?"""
    return status in (RETRY_STATUSES_IDEMPOTENT if idempotent else RETRY_STATUSES_ANY)


def may_have_arrived(exc: TransportError) -> bool:
    """True when the request may have reached the gateway before ``exc`` (so a retry may see its effect)."""
    return not isinstance(exc, NOT_SENT_ERRORS)
