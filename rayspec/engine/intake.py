"""A request's way in: the chat template's prompt, the checks a request passes before it queues
(token ids in the vocabulary, the prompt and its output within max_model_len and the KV pool), and
a resumed request's output taken over.
Plain functions of the request and the engine's limits; the engine raises what they raise."""

from __future__ import annotations

import json

from rayspec.engine.outputs import InvalidRequestError
from rayspec.sampling.sampler import SamplingParams
from rayspec.sampling.tools import inline_tools, template_messages


def encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True) -> list[int]:
    """The chat template's prompt; `tools` (function definitions, rayspec.sampling.tools) go to the
    template, or into the system message where the template has no place for them."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model has no chat template")
    if tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        template = tokenizer.chat_template
        if "tools" in (template if isinstance(template, str) else json.dumps(template)):
            messages = template_messages(messages)  # it renders tools, calls and results (Llama 3.1, Qwen)
        else:  # e.g. SmolLM2's: tools described in the system message, calls written out as JSON
            messages, tools = inline_tools(messages, tools or []), None
    text = tokenizer.apply_chat_template(
        messages, tools=[{"type": "function", "function": t} for t in tools] if tools else None,
        add_generation_prompt=add_generation_prompt, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def check_request(prompt_ids: list[int], params: SamplingParams, vocab: int, max_model_len: int,
                  pool_tokens: int, max_k: int, kv_cache_memory_gb: float) -> int:
    """Raise InvalidRequestError for a request the engine cannot serve; else its max_tokens (the
    room left in max_model_len where the request gives none). pool_tokens: the KV pool's positions."""
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty")
    if any(not 0 <= t < vocab for t in prompt_ids):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
    if params.logit_bias and any(not 0 <= t < vocab for t in params.logit_bias):
        raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab})")
    if any(not 0 <= t < vocab for t in params.stop_token_ids):
        raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab})")
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise InvalidRequestError(
            f"the prompt has {len(prompt_ids)} tokens; this model serves at most {max_model_len} in all")
    max_tokens = params.max_tokens if params.max_tokens is not None else room
    if max_tokens > room:
        raise InvalidRequestError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len ({max_model_len})")
    if len(prompt_ids) + max_tokens + max_k > pool_tokens:
        raise InvalidRequestError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) + {max_k} draft positions "
            f"exceed the whole KV cache ({pool_tokens} tokens, kv_cache_memory_gb {kv_cache_memory_gb:g})")
    return max_tokens


def resume(seq, output_ids: list[int], sent_chars: int, vocab: int, max_tokens: int) -> None:
    """A new Sequence continues a generation another engine started (a replica that died): those
    output tokens are taken as already generated (their text and stop conditions replayed, counted
    against max_tokens), and the first `sent_chars` characters of their text are not handed out
    again, nor their logprobs."""
    if any(not 0 <= t < vocab for t in output_ids):
        raise InvalidRequestError(f"resumed output token ids must be in [0, {vocab})")
    if len(output_ids) >= max_tokens:
        raise InvalidRequestError("the resumed output leaves no token to generate")
    seq.append_tokens(list(output_ids))  # replays the text and the stop conditions
    if seq.finished:
        raise InvalidRequestError("the resumed output already ends the request")
    seq.first_token_time = None
    seq.mark_sent(sent_chars)
    seq.num_reported_tokens = seq.num_output_tokens  # the other engine reported those
    if seq.logprobs is not None:  # those tokens' logprobs were handed out by the other engine
        seq.logprobs.extend([None] * seq.num_output_tokens)
