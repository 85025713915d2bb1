"""Admission by work (#51): a verifier replica takes in at most `work_budget_tokens` of work at once.

Counting requests is not enough: one `{"prompt": [1]*2047, "n": 64, "max_tokens": 0, "echo": true,
"logprobs": 20}` is ~2.75M tokenizer decodes on the engine's thread and a ~100 MB response, and 48
requests of n=8 x 512 tokens all admitted leave every client waiting on all of them. So each request
is weighed, in tokens, before it is queued to the engine, and refused at once when it does not fit.

The cost model, per choice (a request of p prompts x n choices costs the sum of its choices):

    cost = prompt + max_tokens          the KV positions it may hold: each a row of its prefill or a
                                        step of its decoding
         + prompt x (1 + k)             with prompt logprobs of k alternatives (completions' `echo`
                                        with `logprobs` k): every prompt position's row is read out,
                                        and its token and k alternatives decoded to text (on the
                                        engine's thread, in the prefill step) and sent back
         + prompt                       with `echo`: the prompt's text, decoded and sent back

where prompt is the prompt's token count (after the chat template) and max_tokens, when unset, is all
max_model_len leaves. Output logprobs are not weighted: their alternatives are decoded one step at a
time, a token's worth per running sequence per step, as the output comes.

The budget (`work_budget_tokens`, app arg) defaults to BATCHES (4) x engine `max_num_seqs` x
`max_model_len`: four full batches of sequences of the longest length, the work the replica's own
queue holds (Serve's max_ongoing_requests is 4 x max_num_seqs by default), so ordinary concurrency
queues as it did and a request let in waits behind at most about four batches' work, while one
request scoring a long prompt 64 times, or a burst of n=8 requests of hundreds of tokens, does not
fit. (One batch was measured too tight: the suite's ordinary loads, 10 long requests on one replica,
got 429s.) A request that does not fit beside
the work in flight gets a 429 with Retry-After at once (`WorkBudgetExceeded`); when nothing is in
flight every request within the budget fits, so only a request whose work alone is more than the
whole budget is refused for good: a 400 saying why (`WorkTooLargeError`).

Why here, in the verifier replica, and not in the ingress: the replica knows the prompt's tokens (it
templates and tokenizes, off the engine's thread), its engine thread is what the budget protects, and
its budget holds however many ingress replicas send to it. The ingress fans a request's choices out
into separate verifier calls; they carry the request's `group` id and `group_size` (its number of
choices), and the first of them to reach a replica reserves the whole request's work (its own cost x
group_size), which the others draw from. So a request is let in whole or refused whole, never in part:
a burst cannot split the budget among many requests each holding some of its choices while none can
finish. Choices of one request that Serve routes to different replicas reserve the request on each
(conservative: never more work than the budget on a replica). A request's work is released when its
choices end: finished (as the last output is handed on), failed, aborted, their client gone.

Every method runs on the replica's event loop (the verifier's request handlers); no locks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rayspec.engine.outputs import EngineOverloadedError, InvalidRequestError



BATCHES = 4  # the default budget's full batches (see the module docstring)


def default_work_budget(max_num_seqs: int, max_model_len: int) -> int:
    return BATCHES * max_num_seqs * max_model_len

class WorkBudgetExceeded(EngineOverloadedError):
    """The request's work does not fit beside the work in flight on this replica: try later (429)."""

    @property
    def reason(self) -> str:  # what the ingress's 429 says
        return str(self)


class WorkTooLargeError(InvalidRequestError):
    """The request's work is more than a replica's whole budget: it can never be let in (400)."""

    code = "request_too_much_work"  # the 400's OpenAI error code


@dataclass(frozen=True)
class Work:
    """One choice's work, in tokens (the cost model above)."""

    prompt: int  # prompt tokens
    output: int  # max_tokens (unset: what max_model_len leaves)
    scored_top: int | None = None  # prompt logprobs asked, with this many alternatives (None: not asked)
    echo: bool = False

    @property
    def tokens(self) -> int:
        scored = self.prompt * (1 + self.scored_top) if self.scored_top is not None else 0
        return self.prompt + self.output + scored + (self.prompt if self.echo else 0)

    def describe(self) -> str:
        parts = [f"{self.prompt} prompt + {self.output} output tokens"]
        if self.scored_top is not None:
            parts.append(f"{self.prompt} prompt tokens scored x (1 + {self.scored_top} logprobs)")
        if self.echo:
            parts.append(f"{self.prompt} echoed")
        return " + ".join(parts)


def choice_work(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                prompt_logprobs: int | None = None, echo: bool = False) -> Work:
    output = max_tokens if max_tokens is not None else max(0, max_model_len - num_prompt_tokens)
    return Work(num_prompt_tokens, output, prompt_logprobs, echo)


@dataclass
class _Group:
    """The choices of one request that came to this replica, and the work reserved for them."""

    size: int  # the request's choices (group_size), here or not
    estimate: int  # the work expected of each choice not yet here (the largest seen)
    arrived: int = 0
    running: dict[str, int] = field(default_factory=dict)  # choice key -> its work, until it ends
    charged: int = 0  # what this group holds of the budget

    def need(self) -> int:
        return sum(self.running.values()) + max(0, self.size - self.arrived) * self.estimate


class WorkBudget:
    """One verifier replica's ledger: `in_use` of `budget` tokens of work held by requests in flight."""

    def __init__(self, budget: int):
        if budget < 1:
            raise ValueError(f"the work budget must be at least 1 token, got {budget}")
        self.budget = budget
        self.in_use = 0
        self.num_refused = 0  # choices refused for now (429)
        self.num_too_large = 0  # choices refused for good (400)
        self._groups: dict[str, _Group] = {}
        self._group_of: dict[str, str] = {}  # choice key -> its group

    def admit(self, key: str, work: Work, group: str | None = None, group_size: int = 1, force: bool = False) -> None:
        """Take choice `key` in, or raise WorkBudgetExceeded (429) / WorkTooLargeError (400).
        group: the request it is a choice of (None: a request of its own); group_size: that request's
        choices. force: charged but never refused (a failover resuming a request already let in)."""
        if key in self._group_of:
            raise ValueError(f"choice {key!r} is already in")
        name = group if group is not None else key
        known = self._groups.get(name)
        g = known if known is not None else _Group(max(1, group_size), work.tokens)
        before = (g.arrived, g.estimate)
        g.arrived, g.estimate = g.arrived + 1, max(g.estimate, work.tokens)
        g.running[key] = work.tokens
        need = g.need()
        extra = need - g.charged
        why = None
        if force:
            pass
        elif need > self.budget:
            self.num_too_large += 1
            what = f"{g.size} choices x about {g.estimate}" if g.size > 1 else work.describe()
            why = WorkTooLargeError(
                f"this request is {need} tokens of work ({what}; one choice: {work.describe()}), more than a "
                f"server replica takes in at once (its work budget: {self.budget} tokens, the app arg "
                "work_budget_tokens); ask for fewer choices (n), fewer tokens (max_tokens) or fewer "
                "prompt logprobs")
        elif extra > 0 and self.in_use + extra > self.budget:
            self.num_refused += 1
            why = WorkBudgetExceeded(
                f"this request's work ({need} tokens) does not fit beside the {self.in_use - g.charged} tokens "
                f"of work in flight on this replica (its work budget: {self.budget} tokens)")
        if why is not None:  # undo: nothing of this choice stays
            g.arrived, g.estimate = before
            del g.running[key]
            raise why
        self._groups[name] = g
        self._group_of[key] = name
        g.charged = need
        self.in_use += extra

    def release(self, key: str) -> None:
        """Choice `key` ended (finished, failed, aborted, its caller gone); a key not in is ignored."""
        name = self._group_of.pop(key, None)
        if name is None:
            return
        g = self._groups[name]
        del g.running[key]
        if not g.running:  # none of its choices runs here: what it reserved for choices still to come goes too
            del self._groups[name]
            self.in_use -= g.charged
            return
        need = g.need()
        self.in_use -= g.charged - need
        g.charged = need

    def as_dict(self) -> dict:
        return {"work_budget_tokens": self.budget, "work_in_flight_tokens": self.in_use,
                "num_refused_for_work": self.num_refused, "num_too_large_for_work": self.num_too_large}
