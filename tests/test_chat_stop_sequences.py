"""An Anthropic turn ended by one of its ``stop_sequences`` says so, streamed as unary: ``stop_reason:
"stop_sequence"`` and the sequence matched, from the ``matched`` string SGLang reports in its finish reason.

The simulator stops on token ids only, so the upstream here is a fake (``raw_upstream.RawUpstream``) that answers
every ``/generate`` as SGLang does when a stop string matched; driven by the real ``anthropic`` client against a real
gateway with the chat routes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from chat_checks import anthropic_client, anthropic_turn, new_session
from conftest import Service, run_gateway
from raw_upstream import RawRequest, RawUpstream, Step, chunked, http_response, sglang_answer, sse_event

STOP = "\n\nHuman:"
TOKENS = 3


def _stream(answer: bytes) -> bytes:
    """SGLang's cumulative stream of ``answer``, framed: one chunk per token, the last the whole answer."""
    full = orjson.loads(answer)
    ids, meta = full["output_ids"], full["meta_info"]
    events = []
    for n in range(1, len(ids)):
        partial = {**meta, "finish_reason": None, "completion_tokens": n}
        partial["output_token_logprobs"] = meta["output_token_logprobs"][:n]
        text = "".join(f" w{t}" for t in ids[:n])
        events.append(sse_event(orjson.dumps({"text": text, "output_ids": ids[:n], "meta_info": partial})))
    events += [sse_event(answer), sse_event(b"[DONE]")]
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    return head + chunked(*events)


def _reply(request: RawRequest) -> list[Step]:
    if request.path != "/generate":
        return [http_response(b"{}")]
    asked = request.json or {}
    assert asked["sampling_params"]["stop"] == [STOP]  # the client's stop_sequences reach the model
    finish = {"type": "stop", "matched": STOP}
    answer = sglang_answer(request, tokens=TOKENS, first_token=100, finish=finish)
    return [_stream(answer) if asked.get("stream") else http_response(answer)]


@pytest.fixture(scope="module")
def stopping_gateway(tokenizer_dir: Path) -> Iterator[Service]:
    with (
        RawUpstream(_reply) as upstream,
        run_gateway(upstream.url, "--tokenizer", str(tokenizer_dir), "--log-level", "warning") as gateway,
    ):
        yield gateway


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_turn_ended_by_a_stop_sequence_reports_it(stopping_gateway: Service, stream: bool) -> None:
    sid = new_session(stopping_gateway, moe=False, top_p=False)
    client = anthropic_client(stopping_gateway, sid)
    message = anthropic_turn(
        client,
        stream=stream,
        model="tiny",
        max_tokens=16,
        stop_sequences=[STOP],
        messages=[{"role": "user", "content": "Say something."}],
    )
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", STOP)
    assert [block.text for block in message.content] == [" w100 w101 w102"]
    assert message.usage.output_tokens == TOKENS
