"""Expected speedup of asynchronous drafting (the proposer pre-drafts while the target verifies)
over synchronous drafting (draft, then verify), from measured step times.

Synchronous step:  draft + verify + rest.
Asynchronous step: the verifier sends the verdict `verify + rest` after it got the last draft; by
then the proposer has pre-drafted its hypotheses one after the other (a lookahead forward, then
`hypothesis` seconds each, in the order of their rank). The verdict matches hypothesis i with
probability hit_rates[i]:
  - a hit whose pre-draft is done answers at once; one still being drafted is waited for;
  - a miss (no hypothesis matched, or the match was never started) first lets the forward in
    flight finish (half a forward on average, if the proposer is still busy) and drafts then.
Every call, hit or miss, also pays the disaggregated call's own cost `call` (transport, the
handler; measured: the verifier's call time less the proposer's drafting on misses), and a miss
drafts for `miss_draft` (the proposer's own drafting time on a call; default `draft`). The
verifier of an asynchronous app may step faster or slower than the synchronous one without the
drafting (another process layout, its own core): `verify_async` (default verify + rest) is its
verify + rest. Greedy drafts are the same tokens either way for a draft model; an EAGLE head's
pre-drafts are made from its own states in place of the target's features, so acceptance_async
below acceptance_sync models them (hit_rate x accepted after hits + the rest after misses).

    python benchmarks/async_model.py --draft 40 --verify 50 --rest 10 --hypothesis 45 \
        --lookahead 10 --hit-rates 0.45,0.15,0.1 --forward 10 --call 3
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field


@dataclass
class StepTimes:
    """Seconds (or any one unit) of a synchronous step, and of the asynchronous proposer's work."""
    draft: float  # drafting on a call (the synchronous proposer's share of a step)
    verify: float  # the target's verification forward
    rest: float  # everything else on the step's path: scheduling, sampling, transport
    hypothesis: float  # pre-drafting one hypothesis (catch-up plus the draft)
    lookahead: float = 0.0  # the forward after a draft that ranks the hypotheses (before the first)
    forward: float = 0.0  # one draft forward: what a miss waits for when the proposer is busy
    hit_rates: list[float] = field(default_factory=list)  # P(verdict = hypothesis i), by rank
    acceptance_sync: float = 1.0  # tokens per step, synchronous
    acceptance_async: float | None = None  # tokens per step, asynchronous (None: as synchronous)
    call: float = 0.0  # the disaggregated call's own cost, every step
    miss_draft: float | None = None  # drafting on a miss in the proposer (None: draft)
    verify_async: float | None = None  # the asynchronous verifier's verify + rest (None: verify + rest)

    def __post_init__(self):
        if min(self.draft, self.verify, self.rest, self.hypothesis, self.lookahead, self.forward, self.call,
               self.miss_draft or 0.0, self.verify_async or 0.0) < 0:
            raise ValueError("times must be >= 0")
        if any(h < 0 for h in self.hit_rates) or sum(self.hit_rates) > 1 + 1e-9:
            raise ValueError("hit rates must be >= 0 and sum to at most 1")


def sync_step(t: StepTimes) -> float:
    return t.draft + t.verify + t.rest


def overlap_bound(t: StepTimes) -> float:
    """B: the speedup if drafting cost nothing on the step's path (every verdict a ready hit)."""
    return sync_step(t) / (t.verify + t.rest)


def async_step(t: StepTimes) -> float:
    """Expected asynchronous step time (see the module docstring)."""
    # the verdict reaches the proposer this long after its last reply
    arrival = t.verify + t.rest if t.verify_async is None else t.verify_async
    step = 0.0
    for i, rate in enumerate(t.hit_rates):
        ready = t.lookahead + (i + 1) * t.hypothesis
        step += rate * (arrival + max(0.0, ready - arrival))
    busy = t.lookahead + len(t.hit_rates) * t.hypothesis > arrival
    miss = arrival + (t.forward / 2 if busy else 0.0) + (t.draft if t.miss_draft is None else t.miss_draft)
    return step + (1 - sum(t.hit_rates)) * miss + t.call


def speedup(t: StepTimes) -> float:
    """Asynchronous over synchronous, in tokens per second."""
    acceptance_async = t.acceptance_sync if t.acceptance_async is None else t.acceptance_async
    return (acceptance_async / async_step(t)) / (t.acceptance_sync / sync_step(t))


def goal(t: StepTimes, share: float = 0.7) -> float:
    """The speedup that takes `share` of the possible gain B - 1."""
    return 1 + share * (overlap_bound(t) - 1)


def from_stats(sync: dict, asynchronous: dict) -> StepTimes:
    """StepTimes from two apps' entries of benchmarks/async_serve.py's {tag}_stats.json (ms): the
    synchronous app's step and drafting times and acceptance, the asynchronous app's verifier step
    (less its proposer call), hit rates by rank, pre-draft time per hypothesis, and the proposer's
    side of the calls: a miss's wait for the forward in flight (the proposer's waits less those of
    hit calls, which wait for their batch) and its drafting after it, and the call's own cost
    outside the proposer (the verifier's call time less the proposer's time in the call)."""
    p = asynchronous["proposer"]
    drafts = max(1, p["speculation_cache_hits"] + p["speculation_cache_misses"])
    misses = max(1, p["speculation_cache_misses"])
    hypothesis = 1e3 * p["pre_draft_seconds"] / max(1, p["pre_drafts"] + p["pre_drafts_interrupted"])
    miss_wait = max(0.0, p["in_proposer_wait_seconds"] - p["in_proposer_hit_call_seconds"]) / misses
    return StepTimes(draft=sync["draft_ms"], verify=sync["step_ms"] - sync["draft_ms"], rest=0.0,
                     hypothesis=hypothesis, forward=2e3 * miss_wait,  # (a miss waits forward / 2)
                     hit_rates=[h / drafts for h in p["hits_by_rank"]],
                     acceptance_sync=sync["mean_acceptance_length"],
                     acceptance_async=asynchronous["mean_acceptance_length"],
                     call=max(0.0, asynchronous["call_ms_verifier"] - asynchronous["call_ms_in_proposer"]),
                     miss_draft=1e3 * p["miss_draft_seconds"] / misses - 1e3 * miss_wait,
                     verify_async=asynchronous["step_ms"] - asynchronous["call_ms_verifier"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stats", default=None, help="a {tag}_stats.json of benchmarks/async_serve.py: model its "
                   "--sync-app and --async-app (the other inputs are ignored)")
    p.add_argument("--sync-app", default="sync")
    p.add_argument("--async-app", default="async")
    for name in ("draft", "verify", "rest", "hypothesis", "lookahead", "forward", "call"):
        p.add_argument("--" + name, type=float, default=0.0)
    p.add_argument("--miss-draft", type=float, default=None)
    p.add_argument("--verify-async", type=float, default=None)
    p.add_argument("--hit-rates", default="", help="comma-separated, by hypothesis rank")
    p.add_argument("--acceptance-sync", type=float, default=1.0)
    p.add_argument("--acceptance-async", type=float, default=None)
    a = p.parse_args()
    if a.stats:
        import json

        stats = json.loads(open(a.stats).read())
        t = from_stats(stats[a.sync_app], stats[a.async_app])
        print({k: round(v, 3) if isinstance(v, float) else [round(x, 4) for x in v] if isinstance(v, list) else v
               for k, v in vars(t).items()})
        print(f"sync step {sync_step(t):.2f}  async step {async_step(t):.2f}  B {overlap_bound(t):.3f}  "
              f"speedup {speedup(t):.3f}  (70% of the gain: {goal(t):.3f})")
        return
    t = StepTimes(a.draft, a.verify, a.rest, a.hypothesis, a.lookahead, a.forward,
                  [float(x) for x in a.hit_rates.split(",") if x], a.acceptance_sync, a.acceptance_async, a.call,
                  a.miss_draft, a.verify_async)
    print(f"sync step {sync_step(t):.2f}  async step {async_step(t):.2f}  B {overlap_bound(t):.3f}  "
          f"speedup {speedup(t):.3f}  (70% of the gain: {goal(t):.3f})")


if __name__ == "__main__":
    main()
