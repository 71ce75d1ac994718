"""The table's rows, in order: each module has ``NAME`` and ``run(ctx) -> RowResult``."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from bench.core import RowFn
from bench.rows import (
    agent_finish,
    agent_loop,
    chat_turn,
    cluster_replicas,
    decode_fold,
    dropin_turns,
    event_loop,
    group_fetch,
    materialize,
    memory,
    passthrough,
    redis_turn,
    replicas,
    resume_turn,
    routing_traffic,
    stream_turn,
    streaming,
    trainer_bytes,
    ui_render,
    upstream_receive,
)


@dataclass(frozen=True, slots=True)
class Row:
    number: int
    name: str
    run: RowFn


def _row(number: int, module: ModuleType) -> Row:
    return Row(number, module.NAME, module.run)


ROWS: tuple[Row, ...] = (
    _row(1, decode_fold),
    _row(2, trainer_bytes),
    _row(3, materialize),
    _row(4, routing_traffic),
    _row(5, passthrough),
    _row(6, event_loop),
    _row(7, memory),
    _row(8, streaming),
    _row(9, stream_turn),
    _row(10, upstream_receive),
    _row(11, dropin_turns),
    _row(12, group_fetch),
    _row(13, chat_turn),
    _row(14, redis_turn),
    _row(15, replicas),
    _row(16, ui_render),
    _row(17, cluster_replicas),
    _row(18, agent_loop),
    _row(19, agent_finish),
    _row(20, resume_turn),
)
