"""A small, real Hugging Face tokenizer with a tool-calling chat template, made on the spot (nothing downloaded).

The chat routes, their tests, ``make demo`` and the bench need a tokenizer directory like a served model's: this
builds one. It is a byte-level BPE (so any text encodes, and merges make token boundaries as real ones do) trained
on a fixed corpus, saved with ``transformers`` as ``tokenizer.json`` + ``tokenizer_config.json`` with the chat
template below, and read back by ``AutoTokenizer.from_pretrained(path)`` like any model's tokenizer.

The template follows the ChatML / Qwen2.5 conventions (``<|im_start|>role ... <|im_end|>``, tools listed in the
system turn, Hermes-style ``<tool_call>{json}</tool_call>`` calls, tool results inside a user turn as
``<tool_response>``), written for this project. ``tool_format`` picks another tool-call format, by SGLang's
``--tool-call-parser`` name (``TOOL_FORMATS``): the same template with the assistant's calls rendered as that model
family's template renders them (``qwen3_coder``, ``glm45``, ``glm47``, ``kimi_k2``, ``deepseekv3``, ``deepseekv31``,
``deepseekv32``, ``minimax-m2``, ``gpt-oss``), so that a model writing that format gives a session whose tokens are
the template's one-shot rendering; the format's markers are single tokens (added, not special, so they stay in the
decoded text). A ``TokenizerSpec`` instead gives a whole chat format of its own (another family's template, role
and stop tokens; ``tests/families.py``).

    python -m sglang_sim.tiny_tokenizer OUT_DIR [--tool-format NAME]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
VOCAB_SIZE = 1024

# The template is ChatML with the tools in the system turn; what differs between the tool-call formats (the
# instructions after the tool list, an assistant message's calls, a tool result) is put in at the @...@ marks.
_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions. Their signatures, within <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\n@INSTRUCTIONS@<|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'tool' %}
@TOOL_RESULT@
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant\\n' }}
@CALLS@
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Tool results inside a user turn, as <tool_response> blocks (Qwen's way; they pair with calls by position).
_TOOL_RESPONSE = """\
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"""

# Content, a newline, then the calls one per block, a newline between blocks; @CALL@ is one call (``function``).
_CALL_BLOCKS = """\
{%- if message.content %}{{- message.content + '\\n' }}{%- endif %}
{%- for call in message.tool_calls %}
{%- set function = call.function if call.function is defined else call %}
{%- if not loop.first %}{{- '\\n' }}{%- endif %}
@CALL@
{%- endfor %}"""

_ARGUMENTS_JSON = (
    "{%- if function.arguments is string %}{{- function.arguments }}"
    "{%- else %}{{- function.arguments | tojson }}{%- endif %}"
)


def _bare_values(open_key: str, between: str, close_value: str) -> str:
    """Each argument as its key, then its value: a string as it is, anything else as JSON (Qwen3.5 / GLM)."""
    return (
        "{%- if function.arguments is mapping %}{%- for key, value in function.arguments.items() %}\n"
        f"{{{{- '{open_key}' + key + '{between}' }}}}"
        "{%- if value is string %}{{- value }}{%- else %}{{- value | tojson }}{%- endif %}"
        f"{{{{- '{close_value}' }}}}\n"
        "{%- endfor %}{%- endif %}"
    )


@dataclass(frozen=True)
class ToolFormat:
    """How one tool-call format's template differs from the others, and what its tokenizer adds."""

    instructions: str  # inside a Jinja '...' literal: what the system turn says after the tool list
    calls: str  # Jinja: an assistant message's content and calls, after its '<|im_start|>assistant\\n'
    tool_result: str = _TOOL_RESPONSE  # Jinja: one tool message
    added_tokens: tuple[str, ...] = ()  # single tokens (not special: they stay in the decoded text)
    corpus: tuple[str, ...] = ()  # more lines for the BPE merges

    def chat_template(self) -> str:
        return (
            _TEMPLATE.replace("@INSTRUCTIONS@", self.instructions)
            .replace("@TOOL_RESULT@", self.tool_result)
            .replace("@CALLS@", self.calls)
        )


_KIMI = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")
_DEEPSEEK = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>")

# By SGLang's --tool-call-parser names (gateway.chat.tool_parsers reads each).
TOOL_FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat(
        instructions="For each call, answer a JSON object with the function name and arguments within "
        '<tool_call></tool_call> tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}'
        "\\n</tool_call>",
        calls=_CALL_BLOCKS.replace(
            "@CALL@",
            '{{- \'<tool_call>\\n{"name": "\' + function.name + \'", "arguments": \' }}\n'
            f"{_ARGUMENTS_JSON}\n"
            "{{- '}\\n</tool_call>' }}",
        ),
    ),
    "qwen3_coder": ToolFormat(
        instructions="For each call, answer within <tool_call></tool_call> tags:\\n<tool_call>\\n"
        "<function=example_function>\\n<parameter=example_parameter>\\nvalue\\n</parameter>\\n</function>"
        "\\n</tool_call>",
        calls=_CALL_BLOCKS.replace(
            "@CALL@",
            "{{- '<tool_call>\\n<function=' + function.name + '>\\n' }}\n"
            + _bare_values("<parameter=", ">\\n", "\\n</parameter>\\n")
            + "\n{{- '</function>\\n</tool_call>' }}",
        ),
        corpus=(
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
        ),
    ),
    "glm45": ToolFormat(
        instructions="For each call, answer within <tool_call></tool_call> tags:\\n<tool_call>function-name"
        "\\n<arg_key>key</arg_key>\\n<arg_value>value</arg_value>\\n</tool_call>",
        calls=_CALL_BLOCKS.replace(
            "@CALL@",
            "{{- '<tool_call>' + function.name + '\\n' }}\n"
            + _bare_values("<arg_key>", "</arg_key>\\n<arg_value>", "</arg_value>\\n")
            + "\n{{- '</tool_call>' }}",
        ),
        corpus=("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",),
    ),
    "kimi_k2": ToolFormat(
        instructions="Call functions within <|tool_calls_section_begin|><|tool_calls_section_end|>, each as "
        "<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{arguments}<|tool_call_end|>",
        # Content, then the calls section right after it; each call renders its id, and each result names it.
        calls=(
            "{%- if message.content %}{{- message.content }}{%- endif %}\n"
            "{{- '<|tool_calls_section_begin|>' }}\n"
            "{%- for call in message.tool_calls %}\n"
            "{%- set function = call.function if call.function is defined else call %}\n"
            "{{- '<|tool_call_begin|>' + call.id + '<|tool_call_argument_begin|>' }}\n"
            f"{_ARGUMENTS_JSON}\n"
            "{{- '<|tool_call_end|>' }}\n"
            "{%- endfor %}\n"
            "{{- '<|tool_calls_section_end|>' }}"
        ),
        tool_result="{{- '<|im_start|>tool\\n## Return of ' + message.tool_call_id + '\\n' + message.content + "
        "'<|im_end|>\\n' }}",
        added_tokens=(*_KIMI, "<|tool_calls_section_end|>"),
        corpus=("functions.get_weather:0 functions.search:1 ## Return of functions.calculator:2",),
    ),
    "deepseekv31": ToolFormat(
        instructions="Call functions as <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{arguments}"
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        calls=(
            "{%- if message.content %}{{- message.content }}{%- endif %}\n"
            "{{- '<｜tool▁calls▁begin｜>' }}\n"
            "{%- for call in message.tool_calls %}\n"
            "{%- set function = call.function if call.function is defined else call %}\n"
            "{{- '<｜tool▁call▁begin｜>' + function.name + '<｜tool▁sep｜>' }}\n"
            f"{_ARGUMENTS_JSON}\n"
            "{{- '<｜tool▁call▁end｜>' }}\n"
            "{%- endfor %}\n"
            "{{- '<｜tool▁calls▁end｜>' }}"
        ),
        added_tokens=(*_DEEPSEEK, "<｜tool▁calls▁end｜>"),
    ),
}
_DSML = (
    "<｜DSML｜function_calls>",
    "</｜DSML｜function_calls>",
    "<｜DSML｜invoke",
    "</｜DSML｜invoke>",
    "<｜DSML｜parameter",
    "</｜DSML｜parameter>",
)
_HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>")


def _dsml_parameters() -> str:
    """DeepSeek-V3.2's parameters: each says whether it is a string (written as is) or JSON."""
    return (
        "{%- if function.arguments is mapping %}{%- for key, value in function.arguments.items() %}\n"
        "{%- if not loop.first %}{{- '\\n' }}{%- endif %}\n"
        "{{- '<｜DSML｜parameter name=\"' + key + '\" string=\"' + ('true' if value is string else 'false') + '\">' }}"
        "{%- if value is string %}{{- value }}{%- else %}{{- value | tojson }}{%- endif %}"
        "{{- '</｜DSML｜parameter>' }}\n"
        "{%- endfor %}{%- endif %}"
    )


TOOL_FORMATS |= {
    "glm47": ToolFormat(
        instructions="For each call, answer <tool_call>function-name<arg_key>key</arg_key><arg_value>value"
        "</arg_value></tool_call>",
        # GLM-4.7 writes the parts with nothing between them, and the calls right after the content.
        calls="{%- if message.content %}{{- message.content }}{%- endif %}\n"
        "{%- for call in message.tool_calls %}\n"
        "{%- set function = call.function if call.function is defined else call %}\n"
        "{{- '<tool_call>' + function.name }}\n"
        + _bare_values("<arg_key>", "</arg_key><arg_value>", "</arg_value>")
        + "\n{{- '</tool_call>' }}\n{%- endfor %}",
        corpus=("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>",),
    ),
    "deepseekv3": ToolFormat(
        instructions="Call functions as <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n"
        "```json\\n{arguments}\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        calls=(
            "{%- if message.content %}{{- message.content }}{%- endif %}\n"
            "{{- '<｜tool▁calls▁begin｜>' }}\n"
            "{%- for call in message.tool_calls %}\n"
            "{%- set function = call.function if call.function is defined else call %}\n"
            "{%- if not loop.first %}{{- '\\n' }}{%- endif %}\n"
            "{{- '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + function.name + '\\n```json\\n' }}\n"
            f"{_ARGUMENTS_JSON}\n"
            "{{- '\\n```<｜tool▁call▁end｜>' }}\n"
            "{%- endfor %}\n"
            "{{- '<｜tool▁calls▁end｜>' }}"
        ),
        added_tokens=(*_DEEPSEEK, "<｜tool▁calls▁end｜>"),
        corpus=('```json\n{"city": "Paris"}\n```',),
    ),
    "deepseekv32": ToolFormat(
        instructions='Call functions in a <｜DSML｜function_calls> block of <｜DSML｜invoke name="NAME"> elements, '
        'each of <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter> elements',
        calls=(
            "{%- if message.content %}{{- message.content }}{%- endif %}\n"
            "{{- '\\n\\n<｜DSML｜function_calls>\\n' }}\n"
            "{%- for call in message.tool_calls %}\n"
            "{%- set function = call.function if call.function is defined else call %}\n"
            "{%- if not loop.first %}{{- '\\n' }}{%- endif %}\n"
            "{{- '<｜DSML｜invoke name=\"' + function.name + '\">\\n' }}\n"
            + _dsml_parameters()
            + "\n{{- '\\n</｜DSML｜invoke>' }}\n"
            "{%- endfor %}\n"
            "{{- '\\n</｜DSML｜function_calls>' }}"
        ),
        added_tokens=_DSML,
        corpus=('name="city" string="true"> name="days" string="false">',),
    ),
    "minimax-m2": ToolFormat(
        instructions='Call functions as <minimax:tool_call><invoke name="NAME"><parameter name="KEY">VALUE'
        "</parameter></invoke></minimax:tool_call>",
        calls=(
            "{%- if message.content %}{{- message.content + '\\n' }}{%- endif %}\n"
            "{{- '<minimax:tool_call>\\n' }}\n"
            "{%- for call in message.tool_calls %}\n"
            "{%- set function = call.function if call.function is defined else call %}\n"
            "{{- '<invoke name=\"' + function.name + '\">\\n' }}\n"
            + _bare_values('<parameter name="', '">', "</parameter>\\n")
            + "\n{{- '</invoke>\\n' }}\n"
            "{%- endfor %}\n"
            "{{- '</minimax:tool_call>' }}"
        ),
        corpus=('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>',),
    ),
    "gpt-oss": ToolFormat(
        instructions="Call a function as a harmony message: <|start|>assistant<|channel|>commentary "
        "to=functions.NAME <|constrain|>json<|message|>{arguments}<|call|>",
        # The calls as harmony messages after a ChatML content (the tool-call parser on its own; a whole harmony
        # conversation is tests/families.py's).
        calls=_CALL_BLOCKS.replace(
            "@CALL@",
            "{{- '<|start|>assistant<|channel|>commentary to=functions.' + function.name + "
            "' <|constrain|>json<|message|>' }}\n"
            f"{_ARGUMENTS_JSON}\n"
            "{{- '<|call|>' }}",
        ),
        added_tokens=_HARMONY,
    ),
}
CHAT_TEMPLATE = TOOL_FORMATS["hermes"].chat_template()

# What the BPE merges are learnt from: chat turns, tool calls and JSON, so common pieces become single tokens and
# everything else falls back to bytes.
_CORPUS_LINES = (
    "You are a helpful assistant. You may call tools to answer the user's question.",
    "What is the weather in Paris today? And in Berlin, Tokyo and New York?",
    "The weather in Paris is sunny, 21 degrees. Berlin is cloudy with light rain.",
    "Let me look that up for you. I will call the search tool first.",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '{"name": "search", "arguments": {"query": "population of Tokyo", "limit": 3}}',
    '{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}',
    '{"temperature": 21, "condition": "sunny", "humidity": 0.4, "wind": "light"}',
    "<tool_call>\n</tool_call>\n<tool_response>\n</tool_response>\n<tools>\n</tools>",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "The answer is 84. The population of Tokyo is about 14 million people.",
    "Thank you! Could you also check the forecast for tomorrow morning?",
    "I could not find that. Please try again with a different query.",
    "function name arguments type object properties required string number description",
)


def _corpus(extra: tuple[str, ...] = (), repeat: int = 20) -> Iterator[str]:
    for _ in range(repeat):
        yield from _CORPUS_LINES
        yield from extra


@dataclass(frozen=True)
class TokenizerSpec:
    """Another model family's whole chat format for the tiny tokenizer (``tests/families.py`` writes GLM-4.7,
    MiniMax-M2, DeepSeek-V3.2, Kimi-K2-Thinking and gpt-oss's): its template, and the tokens it needs whole."""

    chat_template: str
    eos_token: str  # one of special_tokens
    special_tokens: tuple[str, ...]  # role markers, stop tokens: special (SGLang leaves them out of the text)
    added_tokens: tuple[str, ...] = ()  # markers that stay in the decoded text
    corpus: tuple[str, ...] = ()


def build_tiny_chat_tokenizer(
    out_dir: str | Path, vocab_size: int = VOCAB_SIZE, tool_format: str = "hermes", spec: TokenizerSpec | None = None
) -> Path:
    """Train and save the tokenizer into ``out_dir`` (created); returns it. Deterministic for a given corpus and
    ``tool_format`` (a ``TOOL_FORMATS`` name), or ``spec`` (a whole chat format of its own)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if tool_format not in TOOL_FORMATS:
        raise ValueError(f"unknown tool format {tool_format!r}; known: {', '.join(TOOL_FORMATS)}")
    chosen = TOOL_FORMATS[tool_format]
    template = chosen.chat_template() if spec is None else spec.chat_template
    eos = EOS_TOKEN if spec is None else spec.eos_token
    special = SPECIAL_TOKENS if spec is None else ("<|endoftext|>", *spec.special_tokens)
    added = chosen.added_tokens if spec is None else spec.added_tokens
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(chosen.corpus if spec is None else spec.corpus), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=eos,
        pad_token="<|endoftext|>",
        additional_special_tokens=[t for t in special if t not in (eos, "<|endoftext|>")],
        model_max_length=32768,
    )
    fast.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    fast.chat_template = template
    fast.save_pretrained(str(out))
    # transformers writes the template to chat_template.jinja or into tokenizer_config.json depending on its
    # version; both are read back by from_pretrained.
    calls = "" if tool_format == "hermes" else f" ({tool_format} tool calls)"
    (out / "README.txt").write_text(
        f"A tiny byte-level BPE chat tokenizer made by sglang_sim.tiny_tokenizer for tests and the demo{calls}.\n"
    )
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sglang_sim.tiny_tokenizer", description=__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    parser.add_argument(
        "--tool-format",
        choices=sorted(TOOL_FORMATS),
        default="hermes",
        help="the tool-call format the chat template renders (SGLang's --tool-call-parser name)",
    )
    args = parser.parse_args(argv)
    path = build_tiny_chat_tokenizer(args.out_dir, args.vocab_size, args.tool_format)
    print(json.dumps({"tokenizer": str(path)}))


if __name__ == "__main__":
    main()
