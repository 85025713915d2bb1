"""Request shapes that once got a 500 (an exception inside validation) get an OpenAI-style 400 with
the parameter named: a logit_bias key that is a digit but not an int ("²"), a json_schema that is not
an object, a tool_choice whose function is not an object."""

from __future__ import annotations

import pytest

from deployments.openai_protocol import ChatCompletionRequest, OpenAIError

MESSAGES = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("extra, param", [
    ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),
    ({"logit_bias": {"\u0663": 1}}, "logit_bias"),  # an Arabic-Indic digit
    ({"response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format"),
    ({"tool_choice": {"type": "function", "function": "x"}, "tools": TOOLS}, "tool_choice"),
])
def test_malformed_fields_are_a_400_naming_the_field(extra, param):
    request = ChatCompletionRequest(model="m", messages=MESSAGES, **extra)
    with pytest.raises(OpenAIError) as err:
        request.check_limits(1, 2048)
        request.to_generate(2048)
    assert err.value.status_code == 400 and err.value.body()["error"]["param"] == param
