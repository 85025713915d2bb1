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
Greedy drafts are the same tokens either way (acceptance unchanged); acceptance_async below
acceptance_sync models drafts made from predicted features (EAGLE pre-drafts).

    python benchmarks/async_model.py --draft 40 --verify 50 --rest 10 --hypothesis 45 \
        --lookahead 10 --hit-rates 0.45,0.15,0.1 --forward 10
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

    def __post_init__(self):
        if min(self.draft, self.verify, self.rest, self.hypothesis, self.lookahead, self.forward) < 0:
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
    arrival = t.verify + t.rest  # the verdict reaches the proposer this long after its last reply
    step = 0.0
    for i, rate in enumerate(t.hit_rates):
        ready = t.lookahead + (i + 1) * t.hypothesis
        step += rate * (arrival + max(0.0, ready - arrival))
    busy = t.lookahead + len(t.hit_rates) * t.hypothesis > arrival
    miss = arrival + (t.forward / 2 if busy else 0.0) + t.draft
    return step + (1 - sum(t.hit_rates)) * miss


def speedup(t: StepTimes) -> float:
    """Asynchronous over synchronous, in tokens per second."""
    acceptance_async = t.acceptance_sync if t.acceptance_async is None else t.acceptance_async
    return (acceptance_async / async_step(t)) / (t.acceptance_sync / sync_step(t))


def goal(t: StepTimes, share: float = 0.7) -> float:
    """The speedup that takes `share` of the possible gain B - 1."""
    return 1 + share * (overlap_bound(t) - 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("draft", "verify", "rest", "hypothesis", "lookahead", "forward"):
        p.add_argument("--" + name, type=float, default=0.0)
    p.add_argument("--hit-rates", default="", help="comma-separated, by hypothesis rank")
    p.add_argument("--acceptance-sync", type=float, default=1.0)
    p.add_argument("--acceptance-async", type=float, default=None)
    a = p.parse_args()
    t = StepTimes(a.draft, a.verify, a.rest, a.hypothesis, a.lookahead, a.forward,
                  [float(x) for x in a.hit_rates.split(",") if x], a.acceptance_sync, a.acceptance_async)
    print(f"sync step {sync_step(t):.2f}  async step {async_step(t):.2f}  B {overlap_bound(t):.3f}  "
          f"speedup {speedup(t):.3f}  (70% of the gain: {goal(t):.3f})")


if __name__ == "__main__":
    main()
