"""slime_wire: the bytes on the wire, shared by the gateway and its SDK.

- ``slime_wire.http1``: keep-alive HTTP/1.1 connections to one origin; llhttp (through ``httptools``) does all the
  protocol parsing, this package owns the pool, deadlines and the rules for when a request may be sent again.
- ``slime_wire.sse``: an incremental server-sent-events decoder that scans every byte once.
- ``slime_wire.errors``: what can go wrong on the way, one small tree that each side translates at its boundary.

No dependency on either side's code: the gateway image and the trainer's SDK both import it.
"""
