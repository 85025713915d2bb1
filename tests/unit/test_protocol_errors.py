"""Request shapes that once got a 500 (an exception inside validation) get an OpenAI-style 400 with
the parameter named: a logit_bias key that is a digit but not an int ("²"), a json_schema that is not
an object, a tool_choice whose function is not an object."""

from __future__ import annotations

import pytest

from deployments.frontend.openai_limits import OpenAIError
from deployments.frontend.openai_requests import ChatCompletionRequest

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


def test_cache_salt_goes_to_the_engine_and_an_empty_one_is_a_400():
    request = ChatCompletionRequest(model="m", messages=MESSAGES, cache_salt="tenant-a")
    (generate,) = request.to_generate(2048)
    assert generate.sampling_params().cache_salt == "tenant-a"
    assert ChatCompletionRequest(model="m", messages=MESSAGES).to_generate(2048)[0].sampling_params().cache_salt is None
    with pytest.raises(ValueError):  # pydantic: the route answers it with a 400 naming cache_salt
        ChatCompletionRequest(model="m", messages=MESSAGES, cache_salt="")
