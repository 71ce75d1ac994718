"""The tool-call parsers (``gateway.chat.tool_parsers``), one layer on its own: each format reads back exactly what its
chat template writes (the project's templates, ``sglang_sim.tiny_tokenizer.TOOL_FORMATS``, rendered here with
Jinja as transformers renders them), values typed by the tool's schema, adversarial text (unclosed, nested, garbage,
huge, unicode, markers inside arguments, text between calls) is all content and ``failed``, and the streamed content
equals the unary content for any split of the text.

The same formats end to end, through the real clients, are in ``tests/test_tool_formats.py``.
"""

from __future__ import annotations

import functools
import itertools
import json
import typing
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.chat.messages import ChatMessage, Tool
from gateway.chat.service import ReplySplitter
from gateway.chat.tool_formats.base import schema_types, typed_value
from gateway.chat.tool_parsers import ALIASES, FORMATS, ParsedCompletion
from gateway.config import Settings
from sglang_sim.tiny_tokenizer import TOOL_FORMATS

NAMES = sorted(FORMATS)
WEATHER = Tool(
    "get_weather",
    "The weather in a city",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "hot": {"type": "boolean"},
            "ratio": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "where": {"type": "object"},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "limit": {"type": ["integer", "null"]},
            "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        },
    },
)
SEARCH = Tool("search", "", {"type": "object", "properties": {"query": {"type": "string"}}})
TOOLS = (WEATHER, SEARCH)


# ---- rendering what the template writes -------------------------------------------------------------------------
def _environment() -> ImmutableSandboxedEnvironment:
    """Jinja as transformers' apply_chat_template sets it up (trim_blocks, lstrip_blocks, its own tojson)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    return env


ENV = _environment()


@functools.cache
def _template(fmt: str) -> Any:
    return ENV.from_string(TOOL_FORMATS[fmt].chat_template())


def written(fmt: str, content: str, calls: list[tuple[str, dict[str, Any]]], ids: list[str] | None = None) -> str:
    """What a model writes for an assistant message: the template's rendering of it, between the assistant's header
    and its close."""
    ids = ids or [f"functions.{name}:{i}" for i, (name, _) in enumerate(calls)]
    message = {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}
            for id_, (name, arguments) in zip(ids, calls, strict=True)
        ],
    }
    tools = [t.template_dict() for t in TOOLS]
    text = _template(fmt).render(
        messages=[{"role": "user", "content": "hi"}, message], tools=tools, add_generation_prompt=False
    )
    head = "<|im_start|>assistant\n"
    return text[text.rindex(head) + len(head) : -len("<|im_end|>\n")]


def parse(fmt: str, text: str, tools: tuple[Tool, ...] = TOOLS) -> ParsedCompletion:
    return FORMATS[fmt].parse(text, tools)


def arguments(parsed: ParsedCompletion) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def assert_all_content(parsed: ParsedCompletion, text: str) -> None:
    assert parsed == ParsedCompletion(text, (), failed=True)


CASES = {
    "one call": ("Let me check.", [("get_weather", {"city": "Paris"})]),
    "no content": ("", [("search", {"query": "population of Tokyo"})]),
    "parallel": (
        "Checking both.",
        [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Berlin"}), ("search", {})],
    ),
    "typed values": (
        "Typed.",
        [
            (
                "get_weather",
                {
                    "city": "Zürich 東京 🌧",
                    "days": 7,
                    "hot": False,
                    "ratio": 0.25,
                    "tags": ["a", "b c"],
                    "where": {"lat": 47.4, "nested": {"deep": [1, 2]}},
                    "unit": "celsius",
                    "limit": None,
                    "note": "multi\nline\n  text",
                },
            )
        ],
    ),
    "content with newlines": ("First line.\n\nSecond line:", [("search", {"query": "x"})]),
}


# ---- each format reads what its template writes ------------------------------------------------------------------
def test_every_format_is_a_setting() -> None:
    annotation = Settings.model_fields["chat_tool_parser"].annotation
    assert set(typing.get_args(annotation)) == set(FORMATS) | set(ALIASES)
    assert set(TOOL_FORMATS) == set(FORMATS)
    assert set(NAMES) == {
        "hermes",
        "qwen3_coder",
        "glm45",
        "glm47",
        "kimi_k2",
        "deepseekv3",
        "deepseekv31",
        "deepseekv32",
        "minimax-m2",
        "gpt-oss",
    }
    assert ALIASES == {"qwen": "hermes", "qwen25": "hermes", "glm": "glm45"}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("fmt", NAMES)
def test_each_format_reads_back_what_its_template_writes(fmt: str, case: str) -> None:
    content, calls = CASES[case]
    text = written(fmt, content, calls)
    parsed = parse(fmt, text)
    assert not parsed.failed, text
    assert parsed.content == content
    assert arguments(parsed) == calls
    if fmt == "kimi_k2":  # the format's own ids: the template renders them back
        assert [c.id for c in parsed.tool_calls] == [f"functions.{name}:{i}" for i, (name, _) in enumerate(calls)]
    else:
        ids = [c.id for c in parsed.tool_calls]
        assert all(i.startswith("call_") for i in ids) and len(set(ids)) == len(ids)
    # The parsed message, rendered again, is the text the model wrote: a session stays one trajectory.
    ids = [c.id for c in parsed.tool_calls]
    again = [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]
    assert written(fmt, parsed.content, again, ids) == text


@pytest.mark.parametrize("fmt", NAMES)
def test_text_without_the_marker_is_content_and_not_a_failure(fmt: str) -> None:
    for text in ("", "Just an answer.", "  spaced \n", "<tool_call", "I use <tools> and {json}.", "<｜tool", "<|tool"):
        assert parse(fmt, text) == ParsedCompletion(text, ())


@pytest.mark.parametrize("fmt", NAMES)
def test_parsing_needs_no_tools(fmt: str) -> None:
    """A call to a function the request did not list is still a call (as SGLang's hermes reads it); bare-text values
    are then strings."""
    text = written(fmt, "", [("search", {"query": "x"})])
    parsed = parse(fmt, text, ())
    assert arguments(parsed) == [("search", {"query": "x"})]


# ---- values typed by the schema ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("schema", "text", "value"),
    [
        ({"type": "integer"}, "42", 42),
        ({"type": "integer"}, "-7", -7),
        ({"type": "integer"}, "4.5", "4.5"),  # not an integer: stays text
        ({"type": "integer"}, "three", "three"),
        ({"type": "integer"}, "007", "007"),
        ({"type": "number"}, "4.5", 4.5),
        ({"type": "number"}, "3", 3),
        ({"type": "number"}, "NaN", "NaN"),
        ({"type": "number"}, "Infinity", "Infinity"),
        ({"type": "number"}, "1" * 5000, "1" * 5000),  # past Python's digit limit: text
        ({"type": "boolean"}, "true", True),
        ({"type": "boolean"}, "False", False),  # as Python writes it (the Qwen3-Coder template's `| string`)
        ({"type": "boolean"}, "yes", "yes"),
        ({"type": "null"}, "null", None),
        ({"type": ["integer", "null"]}, "null", None),
        ({"type": ["integer", "null"]}, "5", 5),
        ({"type": "string"}, "42", "42"),
        ({"type": "string"}, "null", "null"),
        ({"type": "string"}, '"quoted"', '"quoted"'),
        ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, "12", 12),
        ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, '"12"', '"12"'),  # a JSON string is text as written
        ({"oneOf": [{"type": "boolean"}, {"type": "object"}]}, '{"a": 1}', {"a": 1}),
        ({"type": "array"}, '["a", 1]', ["a", 1]),
        ({"type": "array"}, "['a', 1]", ["a", 1]),  # a Python list
        ({"type": "array"}, "{1, 2}", "{1, 2}"),  # a Python set is no JSON value
        ({"type": "array"}, "[1, 2", "[1, 2"),
        ({"type": "object"}, '{"a": [1, {"b": null}]}', {"a": [1, {"b": None}]}),
        ({"type": "object"}, "{'a': True, 'b': None}", {"a": True, "b": None}),
        ({"type": "object"}, "[1]", "[1]"),  # an array where an object is asked for
        ({"type": "object"}, "[" * 10_000, "[" * 10_000),
        ({"properties": {"x": {}}}, '{"x": 1}', {"x": 1}),
        ({"items": {}}, "[1]", [1]),
        ({"enum": [1, 2, 3]}, "2", 2),
        ({"enum": ["a", "b"]}, "1", "1"),
        ({"const": True}, "true", True),
        ({}, "42", "42"),  # no type: text
        (None, "42", "42"),
        ({"type": "integer"}, " 42 ", 42),
    ],
)
def test_bare_text_values_take_the_type_their_schema_names(schema: Any, text: str, value: Any) -> None:
    got = typed_value(text, schema)
    assert got == value and type(got) is type(value)


def test_schema_types() -> None:
    assert schema_types({"type": ["string", "null"]}) == {"string", "null"}
    assert schema_types({"anyOf": [{"type": "integer"}, {"oneOf": [{"type": "boolean"}]}]}) == {"integer", "boolean"}
    assert schema_types({"type": 5, "enum": "x"}) == set()
    assert schema_types("integer") == set()


@pytest.mark.parametrize("fmt", ["qwen3_coder", "glm45"])
def test_values_that_do_not_fit_their_schema_stay_strings(fmt: str) -> None:
    text = written(
        fmt,
        "",
        [("get_weather", {"days": "three", "hot": "maybe", "tags": "not a list", "where": "[1]", "other": 5})],
    )
    (call,) = parse(fmt, text).tool_calls
    # ``other`` is not in the schema: its text stays text, though the template wrote it from the number 5.
    assert json.loads(call.arguments) == {
        "days": "three",
        "hot": "maybe",
        "tags": "not a list",
        "where": "[1]",
        "other": "5",
    }


def test_qwen3_coder_values_as_the_original_template_writes_them() -> None:
    """Qwen3-Coder's own template writes values without the newlines around them on some versions, and non-strings
    with ``| string`` (Python's repr)."""
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=where>{'lat': 1.5, 'ok': True}</parameter>\n"
        "<parameter=hot>True</parameter>\n<parameter=city>\n  Paris  \n</parameter>\n</function>\n</tool_call>"
    )
    assert arguments(parse("qwen3_coder", text)) == [
        ("get_weather", {"where": {"lat": 1.5, "ok": True}, "hot": True, "city": "  Paris  "})
    ]


# ---- markers inside arguments ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", NAMES)
def test_markers_inside_arguments_are_text(fmt: str) -> None:
    markers = (
        "<tool_call>",
        "</tool_call>",
        "</parameter>",
        "<parameter=x>",
        "</function>",
        "</arg_value>",
        "<arg_key>",
        "<|tool_call_end|>",
        "<|tool_calls_section_end|>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁calls▁end｜>",
        "</｜DSML｜parameter>",
        "</｜DSML｜invoke>",
        "</｜DSML｜function_calls>",
        "</invoke>",
        "</minimax:tool_call>",
        "<|call|>",
        "<|start|>assistant",
        "```",
    )
    query = "a file that says " + " and ".join(markers) + " in it"
    calls = [("search", {"query": query}), ("get_weather", {"city": "</tool_call>\n</function>"})]
    text = written(fmt, "Writing it.", calls)
    parsed = parse(fmt, text)
    assert not parsed.failed, text
    assert arguments(parsed) == calls


def test_a_close_tag_inside_a_bare_value_ends_it_only_before_the_next_key() -> None:
    text = (
        "<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter> not the end\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    assert arguments(parse("qwen3_coder", text)) == [("search", {"query": "x\n</parameter> not the end"})]
    text = "<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>a</arg_value>b</arg_value>\n</tool_call>"
    assert arguments(parse("glm45", text)) == [("search", {"query": "a</arg_value>b"})]


# ---- malformed: all content, failed ------------------------------------------------------------------------------
MALFORMED = {
    "hermes": [
        '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}',  # unclosed
        '<tool_call>\n{"name": "search", "arguments": {"query": \n</tool_call>',  # broken JSON
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": 5, "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "search", "arguments": [1]}\n</tool_call>',
        '<tool_call>\n{"name": "search", "arguments": "[1]"}\n</tool_call>',
        '<tool_call>\n["search"]\n</tool_call>',
        '<tool_call>\n{"name": "search", "arguments": {"x": NaN}}\n</tool_call>',
        '<tool_call>\n{"name": "search", "arguments": {"x": 1e999}}\n</tool_call>',
        '<tool_call>\n{"name": "search", "arguments": {"x": "\\ud800"}}\n</tool_call>',  # a lone surrogate
        '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>\nDone.',  # text after the calls
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call> and <tool_call>\n{"name": "b", "arguments": {}}'
        "\n</tool_call>",  # text between calls
        '<tool_call>\n<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>\n</tool_call>',  # nested
        "<tool_call></tool_call>",
        "<tool_call>",
    ],
    "qwen3_coder": [
        "<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n</function>",  # unclosed
        "<tool_call>\n<function=search>\n<parameter=query>\nx\n</function>\n</tool_call>",  # parameter unclosed
        "<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n</tool_call>",  # function unclosed
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        "<tool_call>\n<function=se\narch>\n</function>\n</tool_call>",
        "<tool_call>\n<function=search>\n<parameter=>\nx\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=search>\n<parameter=q>\n1\n</parameter>\n<parameter=q>\n2\n</parameter>\n</function>"
        "\n</tool_call>",  # a key twice
        "<tool_call>\n<function=search>\ngarbage\n</function>\n</tool_call>",
        "<tool_call>\n<function=a>\n</function>\n<function=b>\n</function>\n</tool_call>",  # two in one block
        "<tool_call>\n<function=search>\n</function>\n</tool_call>\nDone.",
        '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>',  # hermes is not this format
        "<tool_call>\n<tool_call>\n<function=search>\n</function>\n</tool_call>\n</tool_call>",
        "<tool_call>",
    ],
    "glm45": [
        "<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>x</arg_value>\n",  # unclosed
        "<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>x\n</tool_call>",  # value unclosed
        "<tool_call>search\n<arg_key>query</arg_key>\n</tool_call>",  # key without value
        "<tool_call>\n<arg_key>query</arg_key>\n<arg_value>x</arg_value>\n</tool_call>",  # no name
        "<tool_call>search\n<arg_key></arg_key>\n<arg_value>x</arg_value>\n</tool_call>",
        "<tool_call>search\n<arg_key>q</arg_key><arg_value>1</arg_value><arg_key>q</arg_key><arg_value>2</arg_value>"
        "</tool_call>",
        "<tool_call>search\ngarbage\n</tool_call>",
        "<tool_call>search\n</tool_call>\nDone.",
        '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>',
        "<tool_call>",
    ],
    "kimi_k2": [
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{}"
        "<|tool_call_end|>",  # section unclosed
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{}"
        "<|tool_calls_section_end|>",  # call unclosed
        "<|tool_calls_section_begin|><|tool_calls_section_end|>",  # no calls
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.search<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_calls_section_end|>",  # no index
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>[1]"
        "<|tool_call_end|><|tool_calls_section_end|>",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_calls_section_end|>",  # an id twice
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_calls_section_end|>Done.",
        "<|tool_calls_section_begin|>garbage<|tool_calls_section_end|>",
        "<|tool_calls_section_begin|>",
    ],
    "deepseekv31": [
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{}<｜tool▁call▁end｜>",  # unclosed
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{}<｜tool▁calls▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜><｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{"q": }<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>Done.",
        "<｜tool▁calls▁begin｜>",
    ],
    "glm47": [
        "<tool_call>search<arg_key>query</arg_key><arg_value>x</arg_value>",  # unclosed
        "<tool_call>search<arg_key>query</arg_key><arg_value>x</tool_call>",  # value unclosed
        "<tool_call><arg_key>query</arg_key><arg_value>x</arg_value></tool_call>",  # no name
        "<tool_call>search<arg_key>q</arg_key><arg_value>1</arg_value><arg_key>q</arg_key><arg_value>2</arg_value>"
        "</tool_call>",
        "<tool_call>search</tool_call>Done.",
        "<tool_call>",
    ],
    "deepseekv3": [
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n{}\n```<｜tool▁call▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        # V3.1's form is not V3's
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n[1]\n```<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>\n```json\n{}\n```<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜>",  # no name
        "<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>",
    ],
    "deepseekv32": [
        '<｜DSML｜function_calls>\n<｜DSML｜invoke name="search">\n</｜DSML｜invoke>',  # unclosed
        '<｜DSML｜function_calls>\n<｜DSML｜invoke name="search">\n</｜DSML｜function_calls>',  # invoke unclosed
        '<｜DSML｜function_calls>\n<｜DSML｜invoke name="search">\n<｜DSML｜parameter name="q" string="maybe">x'
        "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>",
        '<｜DSML｜function_calls>\n<｜DSML｜invoke name="search">\n<｜DSML｜parameter name="q" string="true">x'
        "\n</｜DSML｜invoke>\n</｜DSML｜function_calls>",  # parameter unclosed
        '<｜DSML｜function_calls>\n<｜DSML｜invoke name="search">\n<｜DSML｜parameter name="q" string="true">1'
        '</｜DSML｜parameter>\n<｜DSML｜parameter name="q" string="true">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        "</｜DSML｜function_calls>",  # a key twice
        '<｜DSML｜function_calls>\n<｜DSML｜invoke name="">\n</｜DSML｜invoke>\n</｜DSML｜function_calls>',
        "<｜DSML｜function_calls>\n</｜DSML｜function_calls>",
        '<｜DSML｜function_calls>\n<｜DSML｜invoke name="search">\n</｜DSML｜invoke>\n</｜DSML｜function_calls>\nDone.',
        "<｜DSML｜function_calls>",
    ],
    "minimax-m2": [
        '<minimax:tool_call>\n<invoke name="search">\n</invoke>\n',  # unclosed
        '<minimax:tool_call>\n<invoke name="search">\n</minimax:tool_call>',  # invoke unclosed
        '<minimax:tool_call>\n<invoke name="search">\n<parameter name="q">x\n</invoke>\n</minimax:tool_call>',
        '<minimax:tool_call>\n<invoke name="">\n</invoke>\n</minimax:tool_call>',
        "<minimax:tool_call>\n</minimax:tool_call>",
        '<minimax:tool_call>\n<invoke name="search">\ngarbage\n</invoke>\n</minimax:tool_call>',
        '<minimax:tool_call>\n<invoke name="search">\n</invoke>\n</minimax:tool_call>\nDone.',
        "<minimax:tool_call>",
    ],
    "gpt-oss": [
        '<|start|>assistant<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"q": ',  # cut
        "<|start|>assistant<|channel|>commentary to=functions.search <|constrain|>json<|message|>[1]",
        "<|start|>assistant<|channel|>commentary to=browser.search <|constrain|>json<|message|>{}",  # a built-in tool
        "<|start|>assistant<|channel|>commentary <|constrain|>json<|message|>{}",  # no recipient
        "<|start|>assistant<|channel|>commentary to=functions.search <|constrain|>python<|message|>{}",
        "<|start|>user<|channel|>commentary to=functions.search<|message|>{}",
        "<|start|>assistant<|channel|>commentary to=functions.search<|message|>{}<|call|>Done.",
        "<|start|>assistant<|channel|>commentary to=functions.search<|message|>{}<|call|>"
        "<|start|>assistant<|channel|>final<|message|>Done.",  # an answer after the call
        "<|start|>assistant<|channel|>commentary to=functions.",
        "<|start|>",
    ],
}


@pytest.mark.parametrize(("fmt", "body"), [(fmt, body) for fmt, bodies in sorted(MALFORMED.items()) for body in bodies])
def test_malformed_calls_leave_the_whole_text_as_content(fmt: str, body: str) -> None:
    for text in (body, f"Let me check.\n{body}", f"{body}\n\n"):
        assert_all_content(parse(fmt, text), text)


@pytest.mark.parametrize("fmt", NAMES)
def test_every_truncation_of_a_call_is_content_or_whole_calls(fmt: str) -> None:
    """An answer cut anywhere (max_tokens, an abort): never an error; either the text before any marker, or calls
    that are complete, or all content with ``failed``."""
    text = written(fmt, "Checking.", CASES["parallel"][1])
    marker = FORMATS[fmt].start
    for end in range(len(text) + 1):
        cut = text[:end]
        parsed = parse(fmt, cut)
        if marker not in cut:
            assert parsed == ParsedCompletion(cut, ())
        elif parsed.failed:
            assert_all_content(parsed, cut)
        else:
            assert parsed.content == "Checking." and parsed.tool_calls
    assert len(parse(fmt, text).tool_calls) == 3


@pytest.mark.parametrize("fmt", NAMES)
def test_huge_arguments_and_many_calls(fmt: str) -> None:
    big = "x" * 2_000_000
    text = written(fmt, "", [("search", {"query": big})] * 3)
    assert arguments(parse(fmt, text)) == [("search", {"query": big})] * 3
    many = [("search", {"query": str(i)}) for i in range(500)]
    assert arguments(parse(fmt, written(fmt, "", many))) == many
    # A huge unclosed call, and a deeply nested one: content, quickly, no recursion error.
    assert_all_content(parse(fmt, text[:-5]), text[:-5])
    deep = written(fmt, "", [("search", {"query": "x"})]).replace('"x"', "[" * 100_000 + "]" * 100_000)
    if deep != written(fmt, "", [("search", {"query": "x"})]):
        assert_all_content(parse(fmt, deep), deep)


# ---- random text: never an error -----------------------------------------------------------------------------------
_PIECES = [
    "<tool_call>",
    "</tool_call>",
    "<function=search>",
    "</function>",
    "<parameter=query>",
    "</parameter>",
    "<arg_key>",
    "query",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "functions.search:0",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜DSML｜function_calls>",
    '<｜DSML｜invoke name="search">',
    '<｜DSML｜parameter name="query" string="true">',
    "</｜DSML｜parameter>",
    "</｜DSML｜invoke>",
    "</｜DSML｜function_calls>",
    "<minimax:tool_call>",
    '<invoke name="search">',
    '<parameter name="query">',
    "</parameter>",
    "</invoke>",
    "</minimax:tool_call>",
    "<|start|>assistant",
    "<|channel|>commentary to=functions.search <|constrain|>json<|message|>",
    "<|call|>",
    "function<｜tool▁sep｜>search\n```json\n",
    "\n```",
    '{"name": "search", "arguments": {"query": "x"}}',
    '{"query": "x"}',
    "search",
    "\n",
    " ",
    "{",
    "}",
    '"',
    "\\",
    "<",
    ">",
    "|",
    "é",
    "🌧",
    "\x00",
]
random_text = st.lists(st.one_of(st.sampled_from(_PIECES), st.text(max_size=4)), max_size=40).map("".join)


def _check_invariants(fmt: str, text: str) -> ParsedCompletion:
    parsed = parse(fmt, text)
    marker = FORMATS[fmt].start
    if marker not in text:
        assert parsed == ParsedCompletion(text, ())
    elif parsed.failed:
        assert_all_content(parsed, text)
    else:
        assert parsed.content == text[: text.index(marker)].rstrip() and parsed.tool_calls
        for call in parsed.tool_calls:
            assert isinstance(json.loads(call.arguments), dict) and call.name
            (call.id + call.name + call.arguments).encode()  # what an answer carries is valid UTF-8
    return parsed


@pytest.mark.parametrize("fmt", NAMES)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=random_text)
def test_random_text_never_breaks_a_parser(fmt: str, text: str) -> None:
    _check_invariants(fmt, text)


# ---- streaming: the content sent as it arrives equals the unary content ------------------------------------------
def stream(fmt: str, text: str, cuts: list[int]) -> tuple[list[str], str, ParsedCompletion]:
    """Feed ``text`` cut at ``cuts`` through the service's splitter (no reasoning parser); the content pieces sent
    while it arrives, what ``finish`` sends, the unary parse."""
    splitter = ReplySplitter(None, FORMATS[fmt].splitter())
    bounds = [0, *sorted(set(cuts)), len(text)]
    sent = []
    for a, b in itertools.pairwise(bounds):
        reasoning, content = splitter.feed(text[a:b])
        assert reasoning == ""
        sent.append(content)
    parsed = parse(fmt, text)
    reasoning, rest = splitter.finish(ChatMessage("assistant", parsed.content, parsed.tool_calls))
    assert reasoning == ""
    return sent, rest, parsed


def _check_stream(fmt: str, text: str, cuts: list[int]) -> None:
    sent, rest, parsed = stream(fmt, text, cuts)
    so_far = ""
    for piece in sent:
        so_far += piece
        assert parsed.content.startswith(so_far), (so_far, parsed.content)  # never more than the unary content
    assert so_far + rest == parsed.content


@functools.cache
def _texts() -> st.SearchStrategy[str]:
    cases = [written(fmt, content, calls) for fmt in NAMES for content, calls in CASES.values()]
    mixed = st.tuples(st.sampled_from(cases), random_text, st.sampled_from(["", " ", "\n\n", "  \n"])).map(
        lambda t: t[2].join([t[1], t[0]]) if t[2] else t[0] + t[1]
    )
    return st.one_of(st.sampled_from(cases), random_text, mixed)


@pytest.mark.parametrize("fmt", NAMES)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_streamed_content_equals_the_unary_content_for_any_split(fmt: str, data: st.DataObject) -> None:
    text = data.draw(_texts())
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    _check_stream(fmt, text, cuts)


@pytest.mark.parametrize("fmt", NAMES)
def test_streaming_one_character_at_a_time(fmt: str) -> None:
    for content, calls in CASES.values():
        text = written(fmt, content + "   ", calls)
        _check_stream(fmt, text, list(range(len(text))))
        sent, _, parsed = stream(fmt, text, list(range(len(text))))
        assert "".join(sent) == parsed.content == content  # all content went out before the calls were whole
        _check_stream(fmt, text[:-3], list(range(len(text))))  # cut mid-call: all content, streamed the same


def test_a_long_stream_is_not_quadratic() -> None:
    """One piece at a time over a long answer: each feed looks at the new piece (and what was held back), not the
    whole text again (a quadratic splitter takes minutes here)."""
    splitter = FORMATS["hermes"].splitter()
    word = "token "
    sent = sum(len(splitter.feed(word)) for _ in range(400_000))
    assert sent == len(word) * 400_000 - 1  # the last space held back until more text comes


# ---- Kimi-K2's ids ---------------------------------------------------------------------------------------------------
def kimi(*calls: tuple[str, str], sections: int = 1) -> str:
    """Calls as Kimi writes them: (id, arguments JSON), in ``sections`` sections one after the other."""
    written_calls = [f"<|tool_call_begin|>{i}<|tool_call_argument_begin|>{a}<|tool_call_end|>" for i, a in calls]
    per = -(-len(written_calls) // sections)
    blocks = [written_calls[n : n + per] for n in range(0, len(written_calls), per)]
    return "".join(f"<|tool_calls_section_begin|>{''.join(b)}<|tool_calls_section_end|>" for b in blocks)


def test_kimi_ids_that_name_no_function_are_resolved_by_the_tools() -> None:
    """Kimi-K2.5's bare counters (``3``), and client ids the model copied from the history: the one tool, or the one
    tool whose schema holds every argument key; the id stays as written (the template renders it back)."""
    parsed = parse("kimi_k2", kimi(("3", '{"query": "x"}')), (SEARCH,))
    assert [(c.id, c.name) for c in parsed.tool_calls] == [("3", "search")]
    parsed = parse("kimi_k2", kimi(("0", '{"city": "Tokyo", "days": 2}'), ("call_7f3a", '{"query": "y"}')))
    assert [(c.id, c.name) for c in parsed.tool_calls] == [("0", "get_weather"), ("call_7f3a", "search")]
    parsed = parse("kimi_k2", kimi(("toolu_01Ak", '{"city": "x"}'), ("functions.search:7", '{"query": "z"}')))
    expected = [("toolu_01Ak", "get_weather"), ("functions.search:7", "search")]
    assert [(c.id, c.name) for c in parsed.tool_calls] == expected
    for text in (
        kimi(("0", '{"unknown_key": "v"}')),  # no tool has that key
        kimi(("0", "{}")),  # nothing to tell the tools apart
        kimi(("0", '{"city": "x", "query": "y"}')),  # no one tool has both
        kimi(("we ird", '{"city": "x"}')),
    ):
        assert_all_content(parse("kimi_k2", text), text)
    overlapping = (Tool("a", "", {"properties": {"x": {}}}), Tool("b", "", {"properties": {"x": {}, "y": {}}}))
    text = kimi(("1", '{"x": 1}'))
    assert_all_content(parse("kimi_k2", text, overlapping), text)  # two tools fit: which one is a guess


def test_kimi_calls_in_several_sections_are_one_answers_calls() -> None:
    text = "This is a content:" + kimi(
        ("functions.get_weather:0", '{"city": "London"}'), ("functions.get_weather:1", '{"city": "Delhi"}'), sections=2
    )
    parsed = parse("kimi_k2", text)
    assert parsed.content == "This is a content:"
    assert arguments(parsed) == [("get_weather", {"city": "London"}), ("get_weather", {"city": "Delhi"})]
    between = kimi(("functions.search:0", "{}")) + " Now calling next: " + kimi(("functions.search:1", "{}"))
    assert_all_content(parse("kimi_k2", between), between)
