"""Admission by work (#51, deployments/replicas/work_budget.py): the cost model, the replica's ledger
(a request's choices let in together or refused together, 429 beside work in flight, 400 past the
whole budget, everything released as choices end), the ingress's side (choices tagged as one request,
the ledger's refusals as OpenAI errors). No Ray, no model: the verifier and the served app are
tests/engine/test_verifier_admission.py and tests/serve/test_serve_admission_work.py."""

from __future__ import annotations

import json
import random

import pytest

import deployments.frontend.ingress as ingress_module
from deployments.config import load_app_args
from deployments.frontend.openai_requests import ChatCompletionRequest, CompletionRequest
from deployments.replicas.work_budget import WorkBudget, WorkBudgetExceeded, WorkTooLargeError, choice_work
from serve_utils import tiny_args


# ---- the cost model -------------------------------------------------------------------------------
def test_the_cost_model_in_tokens():
    assert choice_work(300, 512, 2048).tokens == 812  # prompt + max_tokens
    assert choice_work(300, None, 2048).tokens == 2048  # max_tokens unset: all max_model_len leaves
    assert choice_work(300, 1, 2048, prompt_logprobs=0).tokens == 300 + 1 + 300  # scored, no alternatives
    assert choice_work(300, 1, 2048, echo=True).tokens == 300 + 1 + 300
    # the request, one choice: prompt + 1 token + 2047 x (1 + 20) scored + 2047 echoed
    heavy = choice_work(2047, 1, 2048, prompt_logprobs=20, echo=True)
    assert heavy.tokens == 2047 + 1 + 2047 * 21 + 2047
    assert "2047 prompt tokens scored x (1 + 20 logprobs)" in heavy.describe() and "echoed" in heavy.describe()


# ---- the ledger -------------------------------------------------------------------------------------
def test_a_request_that_does_not_fit_beside_others_is_refused_until_they_end():
    budget = WorkBudget(1000)
    budget.admit("a", choice_work(100, 500, 2048))
    with pytest.raises(WorkBudgetExceeded, match="600 tokens of work in flight"):
        budget.admit("b", choice_work(100, 400, 2048))  # 600 + 500 > 1000
    budget.admit("c", choice_work(100, 300, 2048))  # 600 + 400 fits exactly
    assert budget.in_use == 1000 and budget.num_refused == 1
    budget.release("a")
    budget.admit("b", choice_work(100, 400, 2048))  # now it fits
    budget.release("b"), budget.release("c"), budget.release("c")  # (a second release is a no-op)
    assert budget.in_use == 0


def test_a_request_larger_than_the_whole_budget_is_a_400_even_when_idle():
    budget = WorkBudget(32_768)  # max_num_seqs 16 x max_model_len 2048, the defaults
    heavy = choice_work(2047, 1, 2048, prompt_logprobs=20, echo=True)
    with pytest.raises(WorkTooLargeError, match="work budget: 32768 tokens") as refused:
        budget.admit("c0", heavy, group="req", group_size=64)
    assert "64 choices" in str(refused.value) and "fewer choices (n)" in str(refused.value)
    assert isinstance(refused.value, ValueError)  # an InvalidRequestError: the ingress's 400
    assert budget.in_use == 0 and budget.num_too_large == 1
    budget.admit("alone", choice_work(2047, None, 2048))  # within the budget: let in
    assert budget.in_use == 2048


def test_a_requests_choices_are_let_in_together_and_released_as_they_end():
    budget = WorkBudget(10_000)
    work = choice_work(100, 900, 2048)  # 1000 each
    budget.admit("r1-0", work, group="r1", group_size=4)
    assert budget.in_use == 4000  # the first choice reserves the whole request
    for i in (1, 2, 3):
        budget.admit(f"r1-{i}", work, group="r1", group_size=4)  # the others draw from it
    assert budget.in_use == 4000
    budget.admit("r2-0", work, group="r2", group_size=4)
    with pytest.raises(WorkBudgetExceeded):  # 8000 in flight: another request of 4000 does not fit, none of it
        budget.admit("r3-0", work, group="r3", group_size=4)
    budget.release("r1-0")
    assert budget.in_use == 7000
    for i in (1, 2, 3):
        budget.release(f"r1-{i}")
    assert budget.in_use == 4000
    budget.release("r2-0")  # r2's other choices never came here (routed elsewhere): its reservation goes too
    assert budget.in_use == 0


def test_a_burst_never_splits_the_budget_among_requests():
    """48 requests of n=8 arriving interleaved (as the ingress fans them out at once): every request is
    let in whole or refused whole, and the work let in stays within the budget."""
    rng = random.Random(0)
    budget = WorkBudget(32_768)
    work = choice_work(400, 512, 2048)
    arrivals = [(r, c) for r in range(48) for c in range(8)]
    rng.shuffle(arrivals)
    let_in: dict[int, int] = {}
    for r, c in arrivals:
        try:
            budget.admit(f"{r}-{c}", work, group=f"req{r}", group_size=8)
            let_in[r] = let_in.get(r, 0) + 1
        except WorkBudgetExceeded:
            pass
        assert budget.in_use <= budget.budget
    assert set(let_in.values()) == {8}  # whole requests only
    assert len(let_in) == 32_768 // (8 * 912) == 4


def test_a_failover_is_charged_but_never_refused():
    budget = WorkBudget(1000)
    budget.admit("a", choice_work(100, 800, 2048))
    budget.admit("resumed", choice_work(100, 800, 2048), force=True)
    assert budget.in_use == 1800
    budget.release("a"), budget.release("resumed")
    assert budget.in_use == 0


def test_a_larger_choice_of_a_batched_request_tops_up_its_reservation():
    budget = WorkBudget(5000)
    budget.admit("0", choice_work(10, 990, 2048), group="g", group_size=2)  # 2 x 1000 reserved
    budget.admit("1", choice_work(500, 1500, 2048), group="g", group_size=2)  # a longer prompt: 1000 + 2000
    assert budget.in_use == 3000
    budget.release("1"), budget.release("0")
    assert budget.in_use == 0


# ---- the ingress's side -------------------------------------------------------------------------------
def _ingress():
    ours = ingress_module.OpenAIIngress.func_or_class.__bases__[0]  # our class under serve.ingress's wrapper
    ingress = object.__new__(ours)
    ours.__init__(ingress, tiny_args("/unused/model"), None)
    return ingress


def test_the_ingress_tags_a_requests_choices_as_one_group():
    ingress = _ingress()
    body = CompletionRequest(model="tiny", prompt=["a", "b"], n=3, max_tokens=4)
    choices = ingress._choice_requests(body)
    assert len(choices) == 6 and len({c.group for c in choices}) == 1 and choices[0].group is not None
    assert {c.group_size for c in choices} == {6}
    again = ingress._choice_requests(body)
    assert again[0].group != choices[0].group  # one group per request
    one = ingress._choice_requests(ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "x"}]))
    assert len(one) == 1 and one[0].group is None and one[0].group_size == 1


def test_the_ledgers_refusals_are_a_429_with_retry_after_and_a_400_saying_why():
    busy = ingress_module._as_openai_error(WorkBudgetExceeded("this request's work (7296 tokens) does not fit"),
                                           None, 2.0)
    response = ingress_module._error_response(busy)
    error = json.loads(response.body)["error"]
    assert response.status_code == 429 and response.headers["retry-after"] == "2"
    assert error["code"] == "server_overloaded" and error["type"] == "rate_limit_error"
    assert "7296 tokens" in error["message"]
    big = ingress_module._as_openai_error(WorkTooLargeError("this request is 3013248 tokens of work"), None, 2.0)
    response = ingress_module._error_response(big)
    error = json.loads(response.body)["error"]
    assert response.status_code == 400 and "retry-after" not in response.headers
    assert error["code"] == "request_too_much_work" and "3013248 tokens of work" in error["message"]


def test_the_budget_is_an_app_arg():
    assert load_app_args({}).work_budget_tokens is None  # the replica's default: max_num_seqs x max_model_len
    assert load_app_args({"work_budget_tokens": 4096}).work_budget_tokens == 4096
    with pytest.raises(ValueError):
        load_app_args({"work_budget_tokens": 0})


def test_the_ingress_refuses_token_id_prompts_past_the_whole_budget_before_queueing():
    """deployments.frontend.choices.check_work: the issue's heavy request ([1] x 2047, n=64, echo with 20
    logprobs) weighed at the ingress (token ids: its work is known without tokenizing) and refused
    with the verifier's 400, without waiting for a verifier place; one within the budget, and a text
    prompt (the verifier tokenizes and weighs it), go on."""
    from deployments.frontend.choices import check_work
    from deployments.transport.protocol import GenerateRequest

    heavy = GenerateRequest(prompt=[1] * 2047, max_tokens=0, prompt_logprobs=20, echo_prompt=True)
    from deployments.frontend.openai_limits import OpenAIError

    with pytest.raises(OpenAIError, match="64 choices") as refused:
        check_work([heavy], 64, budget=4 * 8 * 2048, max_model_len=2048)
    assert refused.value.status_code == 400 and refused.value.code == WorkTooLargeError.code
    check_work([heavy], 1, budget=4 * 8 * 2048, max_model_len=2048)  # 2047 x 23 = 47,081 tokens: fits
    check_work([GenerateRequest(prompt="x " * 2047, max_tokens=0)], 64, budget=100, max_model_len=2048)
    check_work([heavy], 64, budget=None, max_model_len=2048)  # budget not known here: the verifier's call
