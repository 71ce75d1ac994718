"""The reasoning parsers on their own: a completion split into reasoning and content, whole or as it streams.

What must hold: the split follows SGLang's (``<think>`` ... ``</think>``, reasoning stripped, content's leading
whitespace stripped; a completion that starts inside the reasoning has no opening tag; one cut before ``</think>`` is
all reasoning), and the streamed pieces of each channel, joined, equal the split of the whole text, wherever the
text is cut.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.chat.reasoning import REASONING_FORMATS, ThinkStream, ThinkTags

QWEN3 = REASONING_FORMATS["qwen3"]
R1 = REASONING_FORMATS["deepseek-r1"]
assert isinstance(QWEN3, ThinkTags) and isinstance(R1, ThinkTags)


@pytest.mark.parametrize(
    ("fmt", "text", "inside", "expected"),
    [
        (QWEN3, "<think>\nPlan it.\n</think>\n\nThe answer.", False, ("Plan it.", "The answer.")),
        (QWEN3, "  <think>x</think>y", False, ("x", "y")),
        (QWEN3, "No reasoning here.", False, (None, "No reasoning here.")),
        (QWEN3, "Plan it.\n</think>\n\nThe answer.", True, ("Plan it.", "The answer.")),
        (QWEN3, "<think>\ncut off mid-thought", False, ("cut off mid-thought", "")),
        (QWEN3, "The answer. <think>late</think>", False, (None, "The answer. <think>late</think>")),
        (QWEN3, "<think></think>Direct.", False, ("", "Direct.")),
        (R1, "Reasoning.\n</think>\nAnswer.", False, ("Reasoning.", "Answer.")),
        (R1, "<think>Reasoning.</think>Answer.", False, ("Reasoning.", "Answer.")),
        (R1, "all reasoning, no end", False, ("all reasoning, no end", "")),
        (QWEN3, "<think>a</think>b</think>c", False, ("a", "b</think>c")),
    ],
)
def test_split(fmt: ThinkTags, text: str, inside: bool, expected: tuple[str | None, str]) -> None:
    assert fmt.split(text, inside=inside) == expected


def test_a_prompt_that_opens_think_starts_inside() -> None:
    assert QWEN3.starts_inside("<|im_start|>assistant\n<think>\n")
    assert not QWEN3.starts_inside("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking turned off
    assert not QWEN3.starts_inside("<|im_start|>assistant\n")
    assert R1.starts_inside("<|im_start|>assistant\n")


def streamed(fmt: ThinkTags, pieces: list[str], inside: bool) -> tuple[str, str]:
    stream = ThinkStream(fmt, inside=inside)
    reasoning, content = [], []
    for piece in pieces:
        for channel, text in stream.feed(piece):
            (reasoning if channel == "reasoning" else content).append(text)
    whole_reasoning, _ = fmt.split("".join(pieces), inside=inside)
    reasoning.append(stream.finish(whole_reasoning))
    return "".join(reasoning), "".join(content)


TEXTS = [
    "<think>\nPlan it: first A, then B.\n</think>\n\nThe answer is 42.",
    "   <think>  spaced  </think>   content with trailing space  ",
    "No reasoning at all, just text with </think> in it.",
    "<think>\nnever closed, the length ran out",
    "<thi",
    "<think></think>",
    "\n\n",
]


@settings(max_examples=300, deadline=None)
@given(
    text=st.sampled_from(TEXTS) | st.text(alphabet="<>/thinkab \n", max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=8),
    inside=st.booleans(),
    r1=st.booleans(),
)
def test_streamed_channels_equal_the_whole_split(text: str, cuts: list[int], inside: bool, r1: bool) -> None:
    fmt = R1 if r1 else QWEN3
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    reasoning, content = streamed(fmt, pieces, inside)
    whole_reasoning, whole_content = fmt.split(text, inside=inside)
    assert reasoning == (whole_reasoning or "")
    # Content still held back when the stream ends (undecided text, trailing tool markup) is sent by the caller from
    # the parsed reply: what was streamed is always a prefix of it.
    assert whole_content.startswith(content)


def test_reasoning_streams_before_the_end_tag_arrives() -> None:
    stream = ThinkStream(QWEN3, inside=False)
    assert stream.feed("<think>\nStep one") == [("reasoning", "Step one")]
    assert stream.feed(", step two.\n</thi") == [("reasoning", ", step two.")]
    assert stream.feed("nk>\n\nDone.") == [("content", "Done.")]


# ---- the other think-tag formats, and the misses SGLang's names brought up -------------------------------------------
def think(name: str) -> ThinkTags:
    fmt = REASONING_FORMATS[name]
    assert isinstance(fmt, ThinkTags)
    return fmt


@pytest.mark.parametrize(
    ("name", "text", "inside", "expected"),
    [
        # Qwen3.5/3.6 open a call before closing their reasoning: the reasoning ends there, the call is content.
        (
            "qwen3",
            "I need the weather.\n<tool_call>\n<function=x>",
            True,
            ("I need the weather.", "<tool_call>\n<function=x>"),
        ),
        ("qwen3", "<think>Plan.<tool_call>{}</tool_call>", False, ("Plan.", "<tool_call>{}</tool_call>")),
        ("qwen3", "<think>R</think>A<tool_call>{}</tool_call>", False, ("R", "A<tool_call>{}</tool_call>")),
        # A call drafted inside the reasoning, then the reasoning closed: the draft is reasoning (as SGLang reads it).
        (
            "qwen3",
            "<think>Draft <tool_call>{}</tool_call>.</think><tool_call>",
            False,
            ("Draft <tool_call>{}</tool_call>.", "<tool_call>"),
        ),
        # The opening tag repeated (the prompt opened one, the model wrote another): all markup.
        ("qwen3", "<think>\nR\n</think>\n\nA", True, ("R", "A")),
        ("qwen3", "<think><think>R</think>A", False, ("R", "A")),
        ("qwen3", "\n<think>\n<think>\nR</think>A", True, ("R", "A")),
        ("qwen3-thinking", "R</think>A", False, ("R", "A")),
        ("deepseek-r1", "<think>R</think>A", False, ("R", "A")),
        ("deepseek-v3", "R</think>A", True, ("R", "A")),
        ("deepseek-v3", "Just the answer.", False, (None, "Just the answer.")),
        (
            "glm45",
            "<think>I need to think<tool_call>tool call data",
            False,
            ("I need to think", "<tool_call>tool call data"),
        ),
        ("glm45", "R</think>\nA", True, ("R", "A")),
        (
            "kimi_k2",
            "<think>Let me read...<|tool_calls_section_begin|>x",
            False,
            ("Let me read...", "<|tool_calls_section_begin|>x"),
        ),
        ("kimi_k2", "Hello.", False, (None, "Hello.")),
        ("minimax", "R</think>\n\nA", False, ("R", "A")),
        ("minimax", "<think>R</think>A", False, ("R", "A")),
        ("minimax-append-think", "R</think>\n\nA", True, (None, "<think>R</think>\n\nA")),
        ("minimax-append-think", "A", False, (None, "A")),
    ],
)
def test_think_tag_variants(name: str, text: str, inside: bool, expected: tuple[str | None, str]) -> None:
    assert think(name).split(text, inside=inside) == expected


def test_client_reasoning_in_content_is_split_unless_the_format_keeps_it() -> None:
    assert QWEN3.split_history("<think>R</think>A") == ("R", "A")
    assert QWEN3.split_history("A") is None
    assert think("minimax-append-think").split_history("<think>R</think>A") is None  # the content is the model's


# ---- harmony (gpt-oss) --------------------------------------------------------------------------------------------
HARMONY = REASONING_FORMATS["gpt-oss"]
CALL_MESSAGE = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            f"<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant{CALL_MESSAGE}",
            ("Need it.", f"<|start|>assistant{CALL_MESSAGE}"),
        ),
        (CALL_MESSAGE, (None, f"<|start|>assistant{CALL_MESSAGE}")),  # the prompt's <|start|>assistant put back
        (
            "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.",
            ("Think.", "Sunny."),
        ),
        ("<|channel|>final<|message|>Sunny.<|return|>", (None, "Sunny.")),
        (  # a preamble to the user, then the call
            f"<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant{CALL_MESSAGE}",
            (None, f"Checking.<|start|>assistant{CALL_MESSAGE}"),
        ),
        ("<|channel|>analysis<|message|>A<|end|><|start|>assistant<|channel|>analysis<|message|>B<|end|>", ("AB", "")),
        ("<|channel|>analysis<|message|>cut short", ("cut short", "")),
        ("<|channel|>analysis<|message|><|end|><|start|>assistant<|channel|>final<|message|>x", ("", "x")),
        ("plain text, not harmony", (None, "plain text, not harmony")),
        # Where the text stops being harmony, the rest is content as written; what came before keeps its split.
        ("<|channel|>analysis<|message|>R<|end|>garbage", ("R", "garbage")),
        (
            "<|channel|>analysis<|message|>R<|end|><|start|>assistant<|channel|>fin",
            ("R", "<|start|>assistant<|channel|>fin"),
        ),
        ("<|channel|>weird<|message|>x<|end|>", (None, "<|channel|>weird<|message|>x<|end|>")),
        ("<|channel|>analysis<|message|>R<|end|><|start|>user<|message|>hi", ("R", "<|start|>user<|message|>hi")),
    ],
)
def test_harmony_split(text: str, expected: tuple[str | None, str]) -> None:
    assert HARMONY is not None
    assert HARMONY.split(text, inside=False) == expected


# ---- streamed = whole, every format ---------------------------------------------------------------------------------
STREAM_FORMATS = sorted(name for name, fmt in REASONING_FORMATS.items() if fmt is not None)
HARMONY_TEXTS = [
    f"<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant{CALL_MESSAGE}",
    "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>",
    "<|channel|>analysis<|message|>R<|end|>garbage",
    "<|channel|>analysis<|message|>R<|end|><|start|>assistant<|channel|>fin",
    "<|channel",
    "<|channel|>final<|message|>a <|en",
]
_ALPHABET_PIECES = [
    "<think>",
    "</think>",
    "<tool_call>",
    "<|tool_calls_section_begin|>",
    "<|channel|>",
    "analysis",
    "final",
    "commentary to=functions.f",
    "<|message|>",
    "<|end|>",
    "<|start|>",
    "assistant",
    "<|call|>",
    "<|return|>",
    "<",
    "|",
    ">",
    " ",
    "\n",
    "a",
    "b",
]
_random_text = st.lists(st.sampled_from(_ALPHABET_PIECES), max_size=20).map("".join)


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(STREAM_FORMATS),
    text=st.sampled_from(TEXTS + HARMONY_TEXTS) | _random_text,
    data=st.data(),
    inside=st.booleans(),
)
def test_every_format_streams_what_it_splits(name: str, text: str, data: st.DataObject, inside: bool) -> None:
    fmt = REASONING_FORMATS[name]
    assert fmt is not None
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=8))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    stream = fmt.stream(inside=inside)
    reasoning, content = [], []
    for piece in pieces:
        for channel, out in stream.feed(piece):
            (reasoning if channel == "reasoning" else content).append(out)
    whole_reasoning, whole_content = fmt.split(text, inside=inside)
    reasoning.append(stream.finish(whole_reasoning))
    assert "".join(reasoning) == (whole_reasoning or "")
    assert whole_content.startswith("".join(content))  # the rest is sent from the parsed reply
