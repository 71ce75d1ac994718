"""Hold many half-open HTTP connections to a server, as a separate process (each process has its own open-files
limit, so several of them hold more connections than one test process could).

    python tests/halfopen.py --port P --count 10000 [--partial-every 2] [--wait-s 20]

Opens ``count`` TCP connections to 127.0.0.1:P in batches, sends every ``partial-every``-th of them the start of
a request head (never its end) and nothing on the others, then prints one JSON line ``{"event": "ready", ...}``.
From then on it waits (at most ``wait-s``) for the server to close each connection, and prints
``{"event": "done", ...}``: how many were closed, when (seconds after that connection was opened), and what the
server sent before closing (a 408 to a partial head, nothing to a silent connection).
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import sys
import time
from dataclasses import dataclass

PARTIAL_HEAD = b"POST /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl"
BATCH = 500


@dataclass
class Held:
    sock: socket.socket
    partial: bool
    opened_at: float
    received: bytes = b""
    closed_after_s: float | None = None


def open_connections(port: int, count: int, partial_every: int) -> list[Held]:
    held: list[Held] = []
    poller = select.epoll()
    for first in range(0, count, BATCH):
        batch = []
        for index in range(first, min(count, first + BATCH)):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))
            batch.append(Held(sock, partial_every > 0 and index % partial_every == 0, time.monotonic()))
        pending = {h.sock.fileno(): h for h in batch}
        for fd in pending:
            poller.register(fd, select.EPOLLOUT)
        while pending:
            for fd, _ in poller.poll(5.0):
                poller.unregister(fd)
                h = pending.pop(fd)
                if h.partial:
                    h.sock.send(PARTIAL_HEAD)
        held += batch
    poller.close()
    return held


def wait_for_closes(held: list[Held], wait_s: float) -> None:
    poller = select.epoll()
    by_fd = {h.sock.fileno(): h for h in held}
    for fd in by_fd:
        poller.register(fd, select.EPOLLIN | select.EPOLLRDHUP)
    deadline = time.monotonic() + wait_s
    open_fds = set(by_fd)
    while open_fds and time.monotonic() < deadline:
        for fd, _ in poller.poll(0.5):
            h = by_fd[fd]
            try:
                data = h.sock.recv(65536)
            except (ConnectionResetError, BlockingIOError):
                data = b""
            h.received += data
            if not data:
                h.closed_after_s = time.monotonic() - h.opened_at
                poller.unregister(fd)
                open_fds.discard(fd)
    poller.close()


def summary(held: list[Held]) -> dict[str, object]:
    closed = [h for h in held if h.closed_after_s is not None]
    times = sorted(h.closed_after_s for h in closed if h.closed_after_s is not None)
    partial = [h for h in closed if h.partial]
    silent = [h for h in closed if not h.partial]
    answered = [h for h in partial if h.received.startswith(b"HTTP/1.1 408")]
    after = [h.closed_after_s for h in answered if h.closed_after_s is not None]
    return {
        "event": "done",
        "held": len(held),
        "closed": len(closed),
        "closed_after_s": [times[0], times[-1]] if times else None,
        "partial_closed": len(partial),
        "partial_answered_408": len(answered),
        "answered_408_after_s": [min(after), max(after)] if after else None,
        "partial_408_body": next((h.received.split(b"\r\n\r\n", 1)[-1].decode() for h in partial if h.received), None),
        "silent_closed": len(silent),
        "silent_got_bytes": sum(bool(h.received) for h in silent),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--partial-every", type=int, default=2)
    parser.add_argument("--wait-s", type=float, default=20.0)
    args = parser.parse_args()
    started = time.monotonic()
    held = open_connections(args.port, args.count, args.partial_every)
    print(json.dumps({"event": "ready", "held": len(held), "seconds": time.monotonic() - started}), flush=True)
    wait_for_closes(held, args.wait_s)
    print(json.dumps(summary(held)), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
