"""The MoE families slime trains, as chat formats for the tiny tokenizer: GLM-4.7, MiniMax-M2, DeepSeek-V3.2,
Kimi-K2-Thinking and gpt-oss (harmony).

Each template is written for this suite, in its own words, after what the family's model card, chat template and
SGLang's examples show: the role markers, where the reasoning goes and which earlier reasoning a template drops,
how an assistant's calls and a tool's result are rendered, the generation prompt, and the stop tokens the model
ends its turns with. They read the messages as the gateway gives them (``reasoning_content``, arguments as objects).
What they keep of each family is what the gateway's logic meets:

- GLM-4.7: ``[gMASK]<sop>``, ``<|system|>``/``<|user|>``/``<|assistant|>``/``<|observation|>`` roles; the generation
  prompt opens ``<think>``; calls ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>`` right
  after the content; the model ends a turn with the next role's token (``<|observation|>`` after calls, ``<|user|>``
  after an answer), which the template renders as that message's opening.
- MiniMax-M2: ``]~!b[]~b]system`` / ``]~b]user`` / ``]~b]ai`` / ``]~b]tool`` turns closed by ``[e~[``; the generation
  prompt opens ``<think>\\n``; calls in one ``<minimax:tool_call>`` block of ``<invoke>``s; reasoning kept after the
  last user turn (read from ``reasoning_content``, or from ``<think>...</think>`` left in the content).
- DeepSeek-V3.2 (thinking mode, after its ``encoding_dsv32``): ``<｜User｜>...<｜Assistant｜>`` then ``<think>`` for the
  last user turn (``</think>`` for earlier ones, whose answers lose their reasoning); DSML calls after a blank line;
  tool results inside the assistant's turn (``<function_results>``), then ``<think>`` again.
- Kimi-K2-Thinking: ``<|im_user|>user<|im_middle|>`` turns; ``<think>R</think>`` before the content after the last
  user turn, ``<think></think>`` before it; calls with their ids in a ``<|tool_calls_section_begin|>`` section (its
  tokens are special, as in Kimi's tokenizer); ``## Return of ID`` results.
- gpt-oss (harmony): system and developer messages (the tools as a ``functions`` namespace); an assistant turn is
  messages on channels (analysis, commentary with ``to=functions.NAME`` for a call, final); a call ends with
  ``<|call|>``, the last answer with ``<|return|>`` (earlier answers are rendered with ``<|end|>``); the analysis of
  calls is dropped once a final answer follows, and a final answer's analysis is rendered only for the last
  message; tool results are ``<|start|>functions.NAME to=assistant`` messages. Every harmony marker is a special
  token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sglang_sim.tiny_tokenizer import TokenizerSpec

# Shared Jinja: the index of the last user message, a message's reasoning, a call's function.
_LAST_USER = (
    "{%- set ns = namespace(last_user=-1, future_final=false, name='') %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
)
_REASONING = (
    "{%- set reasoning = m.reasoning_content if (m.reasoning_content is defined and m.reasoning_content is not none)"
    " else '' %}"
)
_FUNCTION = "{%- set f = call.function if call.function is defined else call %}"
_ARGS_JSON = "{%- if f.arguments is string %}{{- f.arguments }}{%- else %}{{- f.arguments | tojson }}{%- endif %}"


def _value(var: str) -> str:
    """A bare value: a string as it is, anything else as JSON."""
    return f"{{%- if {var} is string %}}{{{{- {var} }}}}{{%- else %}}{{{{- {var} | tojson }}}}{{%- endif %}}"


GLM47 = (
    _LAST_USER + "{{- '[gMASK]<sop>' }}"
    "{%- if tools %}{{- '<|system|>\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call, answer <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>"
    "</tool_call>.' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}{{- '<|system|>\\n' + m.content }}"
    "{%- elif m.role == 'user' %}{{- '<|user|>\\n' + m.content }}"
    "{%- elif m.role == 'assistant' %}{{- '<|assistant|>' }}" + _REASONING + ""
    "{%- if loop.index0 > ns.last_user and reasoning %}{{- '<think>' + reasoning + '</think>' }}"
    "{%- else %}{{- '</think>' }}{%- endif %}"
    "{{- m.content or '' }}"
    "{%- for call in m.tool_calls or [] %}" + _FUNCTION + "{{- '<tool_call>' + f.name }}"
    "{%- if f.arguments is mapping %}{%- for k, v in f.arguments.items() %}"
    "{{- '<arg_key>' + k + '</arg_key><arg_value>' }}" + _value("v") + "{{- '</arg_value>' }}{%- endfor %}{%- endif %}"
    "{{- '</tool_call>' }}{%- endfor %}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|observation|>' }}{%- endif %}"
    "{{- '<tool_response>' + m.content + '</tool_response>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|><think>' }}{%- endif %}"
)

MINIMAX_M2 = (
    _LAST_USER + "{{- ']~!b[]~b]system\\n' + (messages[0].content if messages and messages[0].role == 'system' else "
    "'You are a helpful assistant.') }}"
    "{%- if tools %}{{- '\\n\\n# Tools\\nYou may call one or more tools to assist with the user query.\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n<tool>' + (tool | tojson) + '</tool>' }}{%- endfor %}"
    '{{- \'\\n</tools>\\n\\nTo call tools, answer <minimax:tool_call>\\n<invoke name="NAME">\\n<parameter '
    'name="KEY">VALUE</parameter>\\n</invoke>\\n</minimax:tool_call>\' }}{%- endif %}'
    "{{- '[e~[\\n' }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'system' %}{{- ']~b]system\\n' + m.content + '[e~[\\n' }}"
    "{%- elif m.role == 'user' %}{{- ']~b]user\\n' + m.content + '[e~[\\n' }}"
    "{%- elif m.role == 'assistant' %}" + _REASONING + "{%- set content = m.content or '' %}"
    # A client that keeps the text (minimax-append-think) sends the reasoning inside the content.
    "{%- if not reasoning and '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].strip('\\n') %}{%- endif %}"
    "{{- ']~b]ai\\n' }}"
    "{%- if reasoning and loop.index0 > ns.last_user %}"
    "{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- content }}"
    "{%- if m.tool_calls %}{{- '\\n<minimax:tool_call>\\n' }}"
    "{%- for call in m.tool_calls %}" + _FUNCTION + "{{- '<invoke name=\"' + f.name + '\">\\n' }}"
    "{%- if f.arguments is mapping %}{%- for k, v in f.arguments.items() %}"
    "{{- '<parameter name=\"' + k + '\">' }}" + _value("v") + "{{- '</parameter>\\n' }}{%- endfor %}{%- endif %}"
    "{{- '</invoke>\\n' }}{%- endfor %}{{- '</minimax:tool_call>' }}{%- endif %}"
    "{{- '[e~[\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- ']~b]tool' }}{%- endif %}"
    "{{- '\\n<response>' + m.content + '</response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '[e~[\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- ']~b]ai\\n<think>\\n' }}{%- endif %}"
)

DEEPSEEK_V32 = (
    _LAST_USER + "{{- '<｜begin▁of▁sentence｜>' }}"
    "{%- if messages and messages[0].role == 'system' %}{{- messages[0].content }}{%- endif %}"
    "{%- if tools %}{{- '\\n\\n## Tools\\nYou can invoke functions by writing a <｜DSML｜function_calls> block of "
    '<｜DSML｜invoke name="NAME"> elements of <｜DSML｜parameter name="KEY" string="true|false">VALUE'
    "</｜DSML｜parameter> elements.\\n<functions>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}{{- '\\n</functions>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'system' %}{{- m.content }}"
    "{%- elif m.role == 'user' %}{{- '<｜User｜>' + m.content + '<｜Assistant｜>' }}"
    "{%- if loop.index0 == ns.last_user %}{{- '<think>' }}{%- else %}{{- '</think>' }}{%- endif %}"
    "{%- elif m.role == 'assistant' %}" + _REASONING + ""
    "{%- if loop.index0 > ns.last_user %}{{- reasoning + '</think>' }}{%- endif %}"
    "{{- m.content or '' }}"
    "{%- if m.tool_calls %}{{- '\\n\\n<｜DSML｜function_calls>\\n' }}"
    "{%- for call in m.tool_calls %}" + _FUNCTION + "{%- if not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<｜DSML｜invoke name=\"' + f.name + '\">\\n' }}"
    "{%- if f.arguments is mapping %}{%- for k, v in f.arguments.items() %}{%- if not loop.first %}{{- '\\n' }}"
    "{%- endif %}{{- '<｜DSML｜parameter name=\"' + k + '\" string=\"' + ('true' if v is string else 'false') + "
    "'\">' }}" + _value("v") + "{{- '</｜DSML｜parameter>' }}{%- endfor %}{%- endif %}"
    "{{- '\\n</｜DSML｜invoke>' }}{%- endfor %}{{- '\\n</｜DSML｜function_calls>' }}{%- endif %}"
    "{{- '<｜end▁of▁sentence｜>' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '\\n\\n<function_results>' }}{%- endif %}"
    "{{- '\\n<result>' + m.content + '</result>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '\\n</function_results>\\n\\n' }}"
    "{%- if loop.index0 >= ns.last_user %}{{- '<think>' }}{%- else %}{{- '</think>' }}{%- endif %}{%- endif %}"
    "{%- endif %}{%- endfor %}"
)

KIMI_K2_THINKING = (
    _LAST_USER
    + "{%- if tools %}{{- '<|im_system|>tool_declare<|im_middle|>' + (tools | tojson) + '<|im_end|>' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}{{- '<|im_system|>system<|im_middle|>' + m.content + '<|im_end|>' }}"
    "{%- elif m.role == 'user' %}{{- '<|im_user|>user<|im_middle|>' + m.content + '<|im_end|>' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_assistant|>assistant<|im_middle|>' }}" + _REASONING + ""
    "{%- if loop.index0 > ns.last_user %}{{- '<think>' + reasoning + '</think>' }}"
    "{%- else %}{{- '<think></think>' }}{%- endif %}"
    "{{- m.content or '' }}"
    "{%- if m.tool_calls %}{{- '<|tool_calls_section_begin|>' }}"
    "{%- for call in m.tool_calls %}" + _FUNCTION + ""
    "{{- '<|tool_call_begin|>' + call.id + '<|tool_call_argument_begin|>' }}" + _ARGS_JSON + ""
    "{{- '<|tool_call_end|>' }}{%- endfor %}{{- '<|tool_calls_section_end|>' }}{%- endif %}"
    "{{- '<|im_end|>' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_system|>tool<|im_middle|>## Return of ' + m.tool_call_id + '\\n' + m.content + '<|im_end|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_assistant|>assistant<|im_middle|>' }}{%- endif %}"
)

GPT_OSS = (
    _LAST_USER
    + "{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\nKnowledge cutoff: "
    "2024-06\\n\\nReasoning: medium\\n\\n# Valid channels: analysis, commentary, final. Channel must be included for "
    "every message.' }}"
    "{%- if tools %}{{- '\\nCalls to these tools must go to the commentary channel: functions.' }}{%- endif %}"
    "{{- '<|end|>' }}"
    "{%- set system = messages[0].content if messages and messages[0].role == 'system' else '' %}"
    "{%- if system or tools %}{{- '<|start|>developer<|message|>' }}"
    "{%- if system %}{{- '# Instructions\\n\\n' + system }}{%- if tools %}{{- '\\n\\n' }}{%- endif %}{%- endif %}"
    "{%- if tools %}{{- '# Tools\\n\\n## functions\\n\\nnamespace functions {\\n' }}"
    "{%- for tool in tools %}{%- set f = tool.function %}"
    "{{- '\\n// ' + (f.description or '') + '\\ntype ' + f.name + ' = (_: ' + (f.parameters | tojson) + ') => any;"
    "\\n' }}"
    "{%- endfor %}{{- '\\n} // namespace functions' }}{%- endif %}"
    "{{- '<|end|>' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'system' %}{{- '<|start|>developer<|message|>' + m.content + '<|end|>' }}"
    "{%- elif m.role == 'user' %}{{- '<|start|>user<|message|>' + m.content + '<|end|>' }}"
    "{%- elif m.role == 'assistant' %}" + _REASONING + ""
    "{%- if m.tool_calls %}"
    "{%- set ns.future_final = false %}"
    "{%- for later in messages[loop.index0 + 1:] %}"
    "{%- if later.role == 'assistant' and not later.tool_calls %}{%- set ns.future_final = true %}{%- endif %}"
    "{%- endfor %}"
    "{%- if reasoning and not ns.future_final %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + reasoning + '<|end|>' }}{%- endif %}"
    "{%- if m.content %}{{- '<|start|>assistant<|channel|>commentary<|message|>' + m.content + '<|end|>' }}{%- endif %}"
    "{%- for call in m.tool_calls %}" + _FUNCTION + ""
    "{{- '<|start|>assistant<|channel|>commentary to=functions.' + f.name + ' <|constrain|>json<|message|>' }}"
    + _ARGS_JSON
    + "{{- '<|call|>' }}{%- endfor %}"
    "{%- elif loop.last and not add_generation_prompt %}"
    "{%- if reasoning %}{{- '<|start|>assistant<|channel|>analysis<|message|>' + reasoning + '<|end|>' }}{%- endif %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + (m.content or '') + '<|return|>' }}"
    "{%- else %}{{- '<|start|>assistant<|channel|>final<|message|>' + (m.content or '') + '<|end|>' }}"
    "{%- endif %}"
    "{%- elif m.role == 'tool' %}"
    "{%- for prev in messages[:loop.index0] %}{%- for call in prev.tool_calls or [] %}"
    "{%- if call.id == m.tool_call_id %}" + _FUNCTION + "{%- set ns.name = f.name %}{%- endif %}"
    "{%- endfor %}{%- endfor %}"
    "{{- '<|start|>functions.' + ns.name + ' to=assistant<|channel|>commentary<|message|>' + (m.content | tojson) "
    "+ '<|end|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)

_HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>")
_THINK = ("<think>", "</think>")


@dataclass(frozen=True)
class Family:
    """One family: its tokenizer, the gateway settings it is served with, and how its model ends a turn."""

    name: str
    tool_parser: str
    reasoning_parser: str
    spec: TokenizerSpec
    call_stop: str  # the token the model ends a turn of calls with
    answer_stop: str  # the token the model ends its answer with
    settings: dict[str, str] = field(default_factory=dict)  # more GATEWAY_CHAT_* settings

    @property
    def stops(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((self.call_stop, self.answer_stop)))

    def env(self, **more: str) -> dict[str, str]:
        settings = {"tool_parser": self.tool_parser, "reasoning_parser": self.reasoning_parser, **self.settings}
        return {f"GATEWAY_CHAT_{k.upper()}": v for k, v in {**settings, **more}.items()}


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "glm-4.7",
            "glm47",
            "glm45",
            TokenizerSpec(
                GLM47,
                "<|endoftext|>",
                ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
                (*_THINK, "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
                ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>",),
            ),
            call_stop="<|observation|>",
            answer_stop="<|user|>",
        ),
        Family(
            "minimax-m2",
            "minimax-m2",
            "minimax",
            TokenizerSpec(
                MINIMAX_M2,
                "[e~[",
                ("]~!b[", "]~b]", "[e~["),
                (*_THINK, "<minimax:tool_call>", "</minimax:tool_call>"),
                ('<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n</invoke>',),
            ),
            call_stop="[e~[",
            answer_stop="[e~[",
        ),
        Family(
            "deepseek-v3.2",
            "deepseekv32",
            "deepseek-v3",
            TokenizerSpec(
                DEEPSEEK_V32,
                "<｜end▁of▁sentence｜>",
                ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"),
                (
                    *_THINK,
                    "<｜DSML｜function_calls>",
                    "</｜DSML｜function_calls>",
                    "<｜DSML｜invoke",
                    "</｜DSML｜invoke>",
                    "<｜DSML｜parameter",
                    "</｜DSML｜parameter>",
                ),
                ('name="city" string="true"> name="days" string="false"> <function_results> <result></result>',),
            ),
            call_stop="<｜end▁of▁sentence｜>",
            answer_stop="<｜end▁of▁sentence｜>",
        ),
        Family(
            "kimi-k2-thinking",
            "kimi_k2",
            "kimi_k2",
            TokenizerSpec(
                KIMI_K2_THINKING,
                "<|im_end|>",
                (
                    "<|im_system|>",
                    "<|im_user|>",
                    "<|im_assistant|>",
                    "<|im_middle|>",
                    "<|im_end|>",
                    "<|tool_calls_section_begin|>",
                    "<|tool_calls_section_end|>",
                    "<|tool_call_begin|>",
                    "<|tool_call_argument_begin|>",
                    "<|tool_call_end|>",
                ),
                _THINK,
                ("functions.get_weather:0 functions.get_time:1 ## Return of",),
            ),
            call_stop="<|im_end|>",
            answer_stop="<|im_end|>",
        ),
        Family(
            "gpt-oss",
            "gpt-oss",
            "gpt-oss",
            TokenizerSpec(
                GPT_OSS,
                "<|return|>",
                _HARMONY,
                (),
                ("analysis commentary final to=functions.get_weather json namespace functions",),
            ),
            call_stop="<|call|>",
            answer_stop="<|return|>",
        ),
    )
}


_MARK = "@@end-of-history@@"


def model_text(
    tokenizer: Any, history: list[dict[str, Any]], message: dict[str, Any], tools: list[dict[str, Any]]
) -> str:
    """What a model trained on the family's template writes for ``message`` after ``history``: the template's
    rendering of the message as the conversation's last, after the rest of the history's last message and the
    generation prompt, up to its stop token (which the template writes, or renders as the next message's opening).
    Found with a mark at the end of the history's last message, since a template may render the history
    differently once the message follows (harmony drops the analysis of calls once an answer follows)."""
    marked = [*history[:-1], {**history[-1], "content": history[-1]["content"] + _MARK}]
    prompt = tokenizer.apply_chat_template(marked, tools=tools or None, add_generation_prompt=True, tokenize=False)
    whole = tokenizer.apply_chat_template(
        [*marked, message], tools=tools or None, add_generation_prompt=False, tokenize=False
    )
    opening = prompt[prompt.index(_MARK) + len(_MARK) :]
    after = whole[whole.index(_MARK) + len(_MARK) :]
    assert after.startswith(opening), "the template renders the history's last message differently"
    text = after[len(opening) :]
    for close in ("<|im_end|>", "[e~[\n", "<｜end▁of▁sentence｜>", "<|call|>", "<|return|>"):
        if text.endswith(close):
            return text[: -len(close)]
    return text
