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
