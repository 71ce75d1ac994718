"""The Responses API's ``previous_response_id``: a continued request's tool results, sent in the order the tools
finished, are rendered in the order of the calls they answer, as on every chat request (the stored history comes
first, then the results are ordered once, by ``ChatService.resolve``).

Driven by the real ``openai`` client against a real gateway and simulator (scripted answers), as in
``tests/test_chat_apis.py``; the session is checked token-exact (``chat_checks.check_trajectory``).
"""

from __future__ import annotations

from typing import Any

from chat_checks import FINAL_TEXT, WEATHER_TOOL, check_trajectory, hermes_call, new_session, openai_client, script
from conftest import Service

WEATHER = {"type": "function", **WEATHER_TOOL["function"]}  # the Responses API's form: the function's fields flat


def test_results_after_a_previous_response_are_put_in_the_order_of_its_calls(
    chat_gateway: Service, chat_sim: Service, tokenizer: Any
) -> None:
    sid = new_session(chat_gateway)
    calls = "\n".join([hermes_call("get_weather", {"city": "Paris"}), hermes_call("get_weather", {"city": "Rome"})])
    script(chat_sim, sid, calls, FINAL_TEXT)
    client = openai_client(chat_gateway, sid)
    first = client.responses.create(model="tiny", input="Paris and Rome?", tools=[WEATHER])
    paris, rome = first.output
    assert (paris.type, rome.type) == ("function_call", "function_call")
    assert (paris.arguments, rome.arguments) == ('{"city":"Paris"}', '{"city":"Rome"}')
    second = client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        input=[
            {"type": "function_call_output", "call_id": rome.call_id, "output": "rome: rainy"},
            {"type": "function_call_output", "call_id": paris.call_id, "output": "paris: sunny"},
        ],
        tools=[WEATHER],
    )
    assert second.output_text == FINAL_TEXT and second.previous_response_id == first.id
    view = check_trajectory(chat_gateway.url, sid, tokenizer, [calls, FINAL_TEXT])
    tool_messages = [m for m in view["chat"]["record"]["messages"] if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in tool_messages] == [
        (paris.call_id, "paris: sunny"),
        (rome.call_id, "rome: rainy"),
    ]
