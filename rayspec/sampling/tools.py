"""Tool (function) calls by constrained decoding, for any model.

A request that must call a tool gets a JSON-schema grammar (rayspec.sampling.structured), so the output is
always a well-formed call and speculation stays lossless (it is structured output):
- one named function: the output is that function's arguments (its `parameters` schema);
- any of the tools ("required"): the output is a JSON array of `{"name", "arguments"}` objects,
  each one of the tools with its own arguments schema (one item unless parallel calls are allowed).

The tools reach the model through its chat template (`tools=`). A template with no place for them
(SmolLM2's ignores `tools`, `tool_calls` and tool results) gets them described in the system
message instead, and earlier calls rendered in the same JSON the model is made to write, so the
conversation still reads as one to the model.

A tool is the `function` object of an OpenAI tool: {"name", "description"?, "parameters"?}.
"""

from __future__ import annotations

import json
from typing import Any

ANY_OBJECT = {"type": "object"}


def arguments_schema(tool: dict) -> dict:
    """The tool's `parameters`; an object with `properties` takes no other keys unless it says so
    (as in OpenAI's strict mode: a small model otherwise pads the call with keys of its own)."""
    schema = tool.get("parameters") or ANY_OBJECT
    if "properties" in schema and "additionalProperties" not in schema:
        schema = {**schema, "additionalProperties": False}
    return schema


def call_schema(tools: list[dict], name: str | None, parallel: bool = True) -> dict:
    """The JSON schema the output must match: `name`'s arguments, or else an array of calls."""
    if name is not None:
        [tool] = [t for t in tools if t["name"] == name]
        return arguments_schema(tool)
    one_call = [{"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": arguments_schema(t)},
                 "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "items": one_call[0] if len(one_call) == 1 else {"anyOf": one_call},
                              "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_calls(text: str, name: str | None) -> list[tuple[str, str]] | None:
    """(function name, arguments as JSON text) per call in an output made under call_schema, or
    None when the text is not a complete call (cut by max_tokens)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if name is not None:
        return [(name, text)]  # the arguments exactly as generated
    if not isinstance(value, list) or not all(isinstance(c, dict) and "name" in c for c in value):
        return None
    return [(c["name"], json.dumps(c.get("arguments", {}))) for c in value]


def describe_tools(tools: list[dict]) -> str:
    lines = ["You can call these functions (JSON schema of each one's arguments):"]
    for t in tools:
        desc = f": {t['description']}" if t.get("description") else ""
        lines.append(f"- {t['name']}{desc}. Arguments: {json.dumps(arguments_schema(t))}")
    lines.append('To call functions, answer with a JSON list of calls: [{"name": ..., "arguments": {...}}].')
    return "\n".join(lines)


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as Hugging Face chat templates take them: tool-call arguments as objects."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"].get("arguments"))}}
                     for c in m["tool_calls"]]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def inline_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """For a template that ignores tools: the tools described in the system message, earlier calls
    written out as the JSON the model is made to produce."""
    out = []
    for m in template_messages(messages):
        if m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
            m = {"role": m["role"], "content": ((m.get("content") or "") + json.dumps(calls)).strip()}
        out.append(m)
    description = describe_tools(tools) if tools else ""
    if description:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{description}".strip()}
        else:
            out.insert(0, {"role": "system", "content": description})
    return out
