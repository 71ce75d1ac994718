"""SGLang's own parser test cases, as data (``tests/fixtures/sglang_parsers/*.json``), through the gateway's parsers.

Each fixture file names its source (``sgl-project/sglang``'s test file and class, the commits read), the parsers (by
SGLang's names), the tools, and per case: the completion text, the chunks SGLang's test streams it in (when it
does), whether the prompt opened the reasoning (``inside``, SGLang's ``force_reasoning``), and what SGLang's parser
returns (``sglang``: reasoning, content and calls). A case where the gateway reads the text differently on purpose
also has ``gateway`` (what it returns instead) and ``differs``: the reason, one of ``DIFFERENCES``, each listed with its
argument in ``docs/agents/model-families.md``.

Each case runs as the chat service runs a completion: the reasoning split, then the tool-call parse (only when tools
are offered); unary, and streamed through the service's ``ReplySplitter`` cut at SGLang's chunks, at every
character, and at seeded random points, which must give exactly the unary answer. Whitespace at the ends of the
reasoning and the content is not compared (the gateway strips it; SGLang's detectors differ among themselves).
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import pytest

from gateway.chat.messages import ChatMessage, Tool
from gateway.chat.reasoning import reasoning_format
from gateway.chat.service import ReplySplitter
from gateway.chat.tool_parsers import ParsedCompletion, tool_format

FIXTURES = Path(__file__).parent / "fixtures" / "sglang_parsers"
DOC = Path(__file__).parent.parent / "docs" / "agents" / "model-families.md"
# Why the gateway reads a case differently from SGLang (docs/agents/model-families.md, "Where the gateway differs").
DIFFERENCES = {
    "salvage",
    "text-after-calls",
    "text-between-calls",
    "close-tag-in-value",
    "unknown-function",
    "escaped-json",
    "not-harmony",
    "builtin-tool",
    "late-think",
}


def _load() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    out = []
    for path in sorted(FIXTURES.glob("*.json")):
        fixture = json.loads(path.read_text())
        for case in fixture["cases"]:
            out.append((f"{path.stem}: {case['case']}", fixture, case))
    return out


CASES = _load()


def _settings(fixture: dict[str, Any], case: dict[str, Any]) -> tuple[Any, Any, tuple[Tool, ...], bool]:
    tools_name = fixture.get("tool_parser")
    reasoning_name = case.get("reasoning_parser", fixture.get("reasoning_parser", "none"))
    tools = tuple(Tool(**t) for t in case.get("tools", fixture.get("tools", [])))
    return (
        tool_format(tools_name) if tools_name else None,
        reasoning_format(reasoning_name),
        tools,
        bool(case.get("inside", False)),
    )


def unary(fixture: dict[str, Any], case: dict[str, Any]) -> tuple[str | None, ParsedCompletion]:
    calls_format, reasoning, tools, inside = _settings(fixture, case)
    reasoning_text, text = (None, case["text"]) if reasoning is None else reasoning.split(case["text"], inside=inside)
    if calls_format is None or not tools:
        return reasoning_text, ParsedCompletion(text, ())
    return reasoning_text, calls_format.parse(text, tools)


def streamed(fixture: dict[str, Any], case: dict[str, Any], pieces: list[str]) -> tuple[str, str]:
    calls_format, reasoning, tools, inside = _settings(fixture, case)
    splitter = ReplySplitter(
        None if reasoning is None else reasoning.stream(inside=inside),
        None if calls_format is None or not tools else calls_format.splitter(),
    )
    sent_reasoning, sent_content = [], []
    for piece in pieces:
        r, c = splitter.feed(piece)
        sent_reasoning.append(r)
        sent_content.append(c)
    reasoning_text, parsed = unary(fixture, case)
    r, c = splitter.finish(ChatMessage("assistant", parsed.content, parsed.tool_calls, reasoning=reasoning_text))
    return "".join(sent_reasoning) + r, "".join(sent_content) + c


def normalized(reasoning: str | None, content: str, calls: list[Any]) -> dict[str, Any]:
    return {"reasoning": (reasoning or "").strip(), "content": content.strip(), "calls": [list(c) for c in calls]}


def expected(answer: dict[str, Any]) -> dict[str, Any]:
    return normalized(answer["reasoning"], answer["content"], answer["calls"])


def cut_sets(case: dict[str, Any], seed: int) -> list[list[str]]:
    text = case["text"]
    rng = random.Random(seed)
    sets = [list(text), [text[: len(text) // 3], text[len(text) // 3 :]]]
    if "chunks" in case:
        assert "".join(case["chunks"]) == text, "the chunks are the text"
        sets.append(case["chunks"])
    for _ in range(4):
        points = sorted({rng.randrange(len(text) + 1) for _ in range(rng.randrange(1, 8))})
        sets.append([text[a:b] for a, b in itertools.pairwise([0, *points, len(text)])])
    return sets


@pytest.mark.parametrize(("fixture", "case"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_sglang_case(fixture: dict[str, Any], case: dict[str, Any]) -> None:
    reasoning, parsed = unary(fixture, case)
    got = normalized(reasoning, parsed.content, [[c.name, json.loads(c.arguments)] for c in parsed.tool_calls])
    if "differs" in case:
        assert case["differs"] in DIFFERENCES, case["differs"]
        assert expected(case["gateway"]) != expected(case["sglang"]), "a difference that is none: drop the note"
        assert got == expected(case["gateway"])
    else:
        assert got == expected(case["sglang"])
    for n, pieces in enumerate(cut_sets(case, seed=n_seed(case))):
        assert streamed(fixture, case, pieces) == (reasoning or "", parsed.content), f"cut set {n}: {pieces!r}"


def n_seed(case: dict[str, Any]) -> int:
    return sum(map(ord, case["case"]))


def test_every_format_has_sglang_cases() -> None:
    """Each new format, and the older ones whose SGLang tests were ported, has its fixture file."""
    tools = {json.loads(p.read_text()).get("tool_parser") for p in FIXTURES.glob("*.json")}
    reasoning = {json.loads(p.read_text()).get("reasoning_parser") for p in FIXTURES.glob("*.json")}
    assert {"glm47", "minimax-m2", "deepseekv3", "deepseekv32", "kimi_k2", "gpt-oss", "qwen3_coder"} <= tools
    assert {"qwen3", "qwen3-thinking", "deepseek-r1", "glm45", "kimi_k2", "minimax"} <= reasoning
    assert "minimax-append-think" in reasoning
    assert "gpt-oss" in reasoning  # gpt_oss.json runs both harmony parsers


def test_every_difference_is_documented() -> None:
    """The docs list each reason the gateway reads a case differently (with its name, so this can check it)."""
    doc = DOC.read_text()
    used = {case["differs"] for _, _, case in CASES if "differs" in case}
    assert used <= DIFFERENCES
    for reason in DIFFERENCES:
        assert f"`{reason}`" in doc, f"docs/agents/model-families.md does not explain `{reason}`"
