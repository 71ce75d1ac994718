"""Transport errors, one tree.

Each user (the gateway, the SDK) translates them into its own errors at one boundary. What matters most is
on which side of the tree an error falls: a ``NotSent`` request may always be sent again, a ``SentError`` one may
have run already.

    TransportError
    ├── NotSent              the request never left: sending it again is always safe
    │   ├── ConnectFailed    no connection could be made (refused, unreachable, connect timeout)
    │   └── PoolTimeout      no connection slot came free in time
    └── SentError            the request may have reached the server: it may have run
        ├── ResponseTimeout  no complete answer before the call's deadline
        ├── ConnectionLost   the connection ended before the answer was complete
        │   └── NoAnswer     ... before any byte of it (a server that died, or a proxy closing for it)
        └── ProtocolViolation  the answer is not valid HTTP/1.1 (framing, status line, headers, sizes)
"""

from __future__ import annotations


class TransportError(Exception):
    """Base of every error raised by ``slime_wire``."""


class NotSent(TransportError):
    """The request did not leave this process."""


class ConnectFailed(NotSent):
    pass


class PoolTimeout(NotSent):
    pass


class SentError(TransportError):
    """The request was written, so the server may have acted on it."""


class ResponseTimeout(SentError):
    pass


class ConnectionLost(SentError):
    pass


class NoAnswer(ConnectionLost):
    """Not a byte of an answer came: the server may still have run the request (it died before answering), so only
    a request whose second run changes nothing (idempotent, or one the server checks, like a turn with ``sync``)
    may be sent again."""


class ProtocolViolation(SentError):
    pass
