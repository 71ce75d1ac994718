"""A small, real Hugging Face tokenizer with a tool-calling chat template, made on the spot (nothing downloaded).

The chat routes, their tests, ``make demo`` and the bench need a tokenizer directory like a served model's: this
builds one. It is a byte-level BPE (so any text encodes, and merges make token boundaries as real ones do) trained
on a fixed corpus, saved with ``transformers`` as ``tokenizer.json`` + ``tokenizer_config.json`` with the chat
template below, and read back by ``AutoTokenizer.from_pretrained(path)`` like any model's tokenizer.

The template follows the ChatML / Qwen2.5 conventions (``<|im_start|>role ... <|im_end|>``, tools listed in the
system turn, Hermes-style ``<tool_call>{json}</tool_call>`` calls, tool results inside a user turn as
``<tool_response>``), written for this project.

    python -m gateway.simulator.tiny_tokenizer OUT_DIR
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
VOCAB_SIZE = 1024

CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions. Their signatures, within <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each call, answer a JSON object with the function name and arguments within \
<tool_call></tool_call> tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n\
</tool_call><|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.content %}{{- message.content + '\\n' }}{%- endif %}
{%- for call in message.tool_calls %}
{%- set function = call.function if call.function is defined else call %}
{%- if not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + function.name + '", "arguments": ' }}
{%- if function.arguments is string %}{{- function.arguments }}{%- else %}{{- function.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

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


def _corpus(repeat: int = 20) -> Iterator[str]:
    for _ in range(repeat):
        yield from _CORPUS_LINES


def build_tiny_chat_tokenizer(out_dir: str | Path, vocab_size: int = VOCAB_SIZE) -> Path:
    """Train and save the tokenizer into ``out_dir`` (created); returns it. Deterministic for a given corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token="<|endoftext|>",
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, "<|endoftext|>")],
        model_max_length=32768,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    # transformers writes the template to chat_template.jinja or into tokenizer_config.json depending on its
    # version; both are read back by from_pretrained.
    (out / "README.txt").write_text(
        "A tiny byte-level BPE chat tokenizer made by gateway.simulator.tiny_tokenizer for tests and the demo.\n"
    )
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gateway.simulator.tiny_tokenizer", description=__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args(argv)
    path = build_tiny_chat_tokenizer(args.out_dir, args.vocab_size)
    print(json.dumps({"tokenizer": str(path)}))


if __name__ == "__main__":
    main()
