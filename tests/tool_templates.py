"""Chat templates with tool support, or thinking, for the tiny models (whose own template has neither): the parts
of real checkpoints' templates that matter here, as tests/api_server.py writes them into a tiny model's folder."""

from __future__ import annotations

# Qwen2.5/Qwen3's tool section (Hermes format), shortened to what the API reads (the tiny models read 512 tokens): the tools shown in the system
# turn, past calls as <tool_call> JSON, tool results as <tool_response> in a user turn.
HERMES_TEMPLATE = """\
{%- if tools %}<|system|>
{%- if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>{{ eos_token }}
{%- elif messages[0].role == 'system' %}<|system|>
{{ messages[0].content }}{{ eos_token }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}
<|user|>
{{ message.content }}{{ eos_token }}
{%- elif message.role == 'assistant' %}
<|assistant|>
{%- if message.content %}
{{ message.content }}
{%- endif %}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}{{ eos_token }}
{%- elif message.role == 'tool' %}
<|user|>
<tool_response>
{{ message.content }}
</tool_response>{{ eos_token }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|assistant|>
{% endif %}"""


# Qwen3-Thinking-2507's way (DeepSeek-R1's too): the reply's opening holds "<think>\n", so the model's reply starts
# inside its thought; a past assistant turn shows its reasoning_content between the markers.
THINKING_TEMPLATE = """\
{%- for message in messages %}
{%- if message.role == 'assistant' %}<|assistant|>
{% if message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content }}{{ eos_token }}
{%- else %}<|{{ message.role }}|>
{{ message.content }}{{ eos_token }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
<think>
{% endif %}"""


# The tool parts of the other families' templates, shortened the same way. A call's arguments come as a JSON string
# (OpenAI's messages) or an object (transformers' convention): written as JSON either way.
_ARGS = "{{ c.function.arguments if c.function.arguments is string else c.function.arguments | tojson }}"

# Mixtral-8x22B-Instruct-v0.1 / Mistral v3: tools in [AVAILABLE_TOOLS], calls after [TOOL_CALLS] as a JSON list.
MISTRAL_TEMPLATE = (
    """\
{{ bos_token }}{%- if tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}
{%- for m in messages %}
{%- if m.role == 'user' or m.role == 'system' %}[INST] {{ m.content }}[/INST]
{%- elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS] [
{%- for c in m.tool_calls %}{"name": "{{ c.function.name }}", "arguments": """
    + _ARGS
    + """}{{ ", " if not loop.last }}{%- endfor %}]{{ eos_token }}
{%- elif m.role == 'assistant' %}{{ m.content }}{{ eos_token }}
{%- elif m.role == 'tool' %}[TOOL_RESULTS] {"content": {{ m.content | tojson }}}[/TOOL_RESULTS]
{%- endif %}
{%- endfor %}"""
)

# gpt-oss (harmony): tools as a TypeScript namespace in the developer message; a call is a commentary message to
# functions.NAME; the reply opens with <|start|>assistant and the model writes its channel. As openai/gpt-oss's own
# template, a last assistant message with no generation prompt after it (a reply to go on with) shows its `thinking`
# as an analysis message before its final one; earlier replies are read without it.
HARMONY_TEMPLATE = (
    """\
<|start|>system<|message|>Reasoning: low<|end|>
{%- if tools %}<|start|>developer<|message|># Tools
namespace functions {
{%- for t in tools %}
type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;
{%- endfor %}
}<|end|>
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'user' or m.role == 'system' %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'assistant' %}
{%- for c in m.tool_calls or [] %}<|start|>assistant<|channel|>commentary to=functions.{{ c.function.name }} \
<|constrain|>json<|message|>"""
    + _ARGS
    + """<|call|>
{%- endfor %}
{%- if loop.last and not add_generation_prompt and m.thinking is defined %}\
<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{%- endif %}
{%- if m.content %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{%- endif %}
{%- elif m.role == 'tool' %}<|start|>functions.tool to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"""
)

# DeepSeek-V3: calls between the tool tokens, each `function<｜tool▁sep｜>NAME` and its arguments in a json block.
DEEPSEEK_TEMPLATE = (
    """\
{{ bos_token }}{%- if tools %}## Tools
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'user' or m.role == 'system' %}<｜User｜>{{ m.content }}
{%- elif m.role == 'assistant' and m.tool_calls %}<｜Assistant｜><｜tool▁calls▁begin｜>
{%- for c in m.tool_calls %}<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ c.function.name }}
```json
"""
    + _ARGS
    + """
```<｜tool▁call▁end｜>{%- endfor %}<｜tool▁calls▁end｜>{{ eos_token }}
{%- elif m.role == 'assistant' %}<｜Assistant｜>{{ m.content }}{{ eos_token }}
{%- elif m.role == 'tool' %}<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>\
<｜tool▁outputs▁end｜>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<｜Assistant｜>{%- endif %}"""
)


# Qwen3's hybrid models: thinking on by default, off with the template's `enable_thinking` switch (an empty thought
# written into the reply's opening).
HYBRID_TEMPLATE = """\
{%- for message in messages %}<|{{ message.role }}|>
{{ message.content }}{{ eos_token }}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{%- if enable_thinking is defined and enable_thinking is false %}
<think>

</think>
{%- endif %}
{% endif %}"""

# A tool call the API tests ask for: its arguments are an enum, so even an untrained model's constrained call is valid.
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Oslo", "Lisbon"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Is it dry in Oslo?"}]

# A checkpoint's own response template for HERMES_TEMPLATE (transformers' response parsing): the tiny template's
# reply opens with <|assistant|> and ends with <|eos|>; calls as Qwen writes them.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r"\s*<tool_call>",
            "close": "</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"\s*<\|eos\|>", "content": "text"},
    },
}
# The same with the model's thought as a field of its own.
THINKING_RESPONSE = RESPONSE_TEMPLATE | {
    "fields": RESPONSE_TEMPLATE["fields"]
    | {"reasoning_content": {"open": "<think>", "close": "</think>", "content": "text"}}
}
