"""summary.json's start and end of the RL stage are means over a tenth of the steps
(arpo_async/jobs/pipeline.py ``tenth_means``), not the first and the last step."""

from __future__ import annotations

from arpo_async.jobs.pipeline import tenth_means


def test_first_and_last_tenth_are_means_over_a_tenth_of_the_steps():
    # a run whose reward rises while its first and last single steps are equal
    rewards = [0.3125] + [0.2] * 9 + [0.3] * 10 + [0.5] * 9 + [0.3125]
    rows = [{"reward_mean": r} for r in rewards]
    out = tenth_means(rows, "reward_mean", "reward")
    assert out == {"reward_first_tenth": round((0.3125 + 0.2 * 2) / 3, 4),
                   "reward_last_tenth": round((0.5 * 2 + 0.3125) / 3, 4)}
    assert out["reward_last_tenth"] > out["reward_first_tenth"]


def test_few_steps_and_missing_values():
    assert tenth_means([{"score_mean": 0.5}, {"score_mean": 1.0}], "score_mean", "acc") == \
        {"acc_first_tenth": 0.5, "acc_last_tenth": 1.0}
    assert tenth_means([{"x": 1}], "score_mean", "acc") == \
        {"acc_first_tenth": None, "acc_last_tenth": None}
