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
