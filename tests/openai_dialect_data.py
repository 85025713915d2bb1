"""Shared data of tests/unit/test_openai_dialect.py and tests/serve/test_openai_dialect_served.py: the
key, a Hermes-style chat template, tools, a schema, a user turn."""

KEY = "dialect-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these tools:
<tools>
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}
</tools>
To call one, answer <tool_call>{"name": <name>, "arguments": <args>}</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content or "" }}
{%- for c in m.tool_calls or [] %}<tool_call>{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}</tool_call>{%- endfor %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "ok"],
          "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "ok": {"type": "boolean"}}}
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]

