"""benchmarks/async_model.py: the asynchronous-drafting simulator's arithmetic on hand-made cases."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from async_model import StepTimes, async_step, goal, overlap_bound, speedup, sync_step  # noqa: E402


def test_every_verdict_a_ready_hit_reaches_the_overlap_bound():
    t = StepTimes(draft=40, verify=50, rest=10, hypothesis=20, hit_rates=[1.0])
    assert sync_step(t) == 100
    assert async_step(t) == 60
    assert speedup(t) == pytest.approx(overlap_bound(t)) == pytest.approx(100 / 60)


def test_no_hits_cost_a_synchronous_step_plus_the_forward_in_flight():
    t = StepTimes(draft=40, verify=50, rest=10, hypothesis=70, forward=10, hit_rates=[0.0])
    assert async_step(t) == 60 + 5 + 40  # the pre-draft was still running when the verdict came
    assert speedup(t) < 1
    idle = StepTimes(draft=40, verify=50, rest=10, hypothesis=20, forward=10, hit_rates=[0.0])
    assert async_step(idle) == 100  # done before the verdict: a miss drafts at once


@pytest.mark.parametrize("rank,expected", [(0, 60), (1, 60), (2, 75)])
def test_a_hit_on_a_hypothesis_not_done_yet_waits_for_it(rank, expected):
    rates = [0.0, 0.0, 0.0]
    rates[rank] = 1.0
    t = StepTimes(draft=40, verify=50, rest=10, hypothesis=25, hit_rates=rates)
    assert async_step(t) == expected


def test_goal_and_acceptance():
    t = StepTimes(draft=40, verify=50, rest=10, hypothesis=40, hit_rates=[0.5],
                  acceptance_sync=3.0, acceptance_async=2.4)
    assert goal(t) == pytest.approx(1 + 0.7 * (100 / 60 - 1))
    assert speedup(t) == pytest.approx((2.4 / async_step(t)) / (3.0 / 100))
    with pytest.raises(ValueError):
        StepTimes(draft=1, verify=1, rest=0, hypothesis=1, hit_rates=[0.7, 0.6])


def test_call_overhead_and_the_asynchronous_verifier():
    t = StepTimes(draft=40, verify=50, rest=10, hypothesis=20, hit_rates=[0.5], call=5, miss_draft=30)
    assert async_step(t) == pytest.approx(0.5 * 60 + 0.5 * (60 + 30) + 5)  # every call pays `call`
    faster = StepTimes(draft=40, verify=50, rest=10, hypothesis=20, hit_rates=[1.0], verify_async=45)
    assert async_step(faster) == 45
