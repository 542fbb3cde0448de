"Hallucination's controls (issue 54): not attempted is an explicit refusal only; bogus questions checked unanswerable; planted cases through the ledger."
import random

import pytest

from slm_bench.methods.hallucination import REFUSAL, REFUSED, answer_of, bogus_questions, needed_values, outcome, outcomes, removes_needed


def program(*lines):
    return "def simple_math_problem() -> int:\n" + "".join(f"    {line}\n" for line in lines)


# a SynthProblem-like record with a distractor sentence (the crayons), as the synth stage writes them
NOAH = {"id": "syn-x", "irrelevant": True, "answer": -89,
        "question": "Noah cycles 4 miles every hour. He travels for 2 hours. Then he goes back 97 miles. Isla has 36 crayons. How far from the start is Noah?",
        "program": program("speed = 4", "hours = 2", "distance = speed * hours", "back = 97", "crayons = 36", "away = distance - back",
                           "result = away", "return result")}


def test_outcome_counts_explicit_refusals_only():
    "A refusal (the refusal line and no number) is not attempted; a crash, a non-number and a bare None without the line are incorrect."
    crash = "    result = undefined_name * 2\n    return result\n"
    bare_none = "    result = None\n    return result\n"
    assert outcome(answer_of(REFUSAL, None), 5) == outcome(answer_of(REFUSAL, None), None) == "not_attempted"
    assert outcome(answer_of(crash, None), 5) == outcome(answer_of(crash, None), None) == "incorrect"
    assert outcome(answer_of(bare_none, None), None) == "incorrect"
    assert outcome(answer_of("    result = 'many'\n    return result\n", None), 5) == "incorrect"  # a non-number runs to None
    assert answer_of(REFUSAL.replace("None", "7"), 7) == 7 and outcome(7, 7) == "correct"  # the line with a number is an answer
    assert outcomes([REFUSED, None, 5], [5, 5, 5])["not_attempted"] == pytest.approx(1 / 3)


def test_the_unanswerable_check_rejects_a_dropped_distractor_and_keeps_a_needed_number():
    "Hand-built record: the program needs 4, 2 and 97, not the crayons' 36."
    assert needed_values(NOAH["program"]) == {4.0: 1, 2.0: 1, 97.0: 1}
    distractor_dropped = "Noah cycles 4 miles every hour. He travels for 2 hours. Then he goes back 97 miles. How far from the start is Noah?"
    hours_dropped = "Noah cycles 4 miles every hour. Then he goes back 97 miles. Isla has 36 crayons. How far from the start is Noah?"
    assert removes_needed(NOAH, distractor_dropped) is False
    assert removes_needed(NOAH, hours_dropped) is True
    same_value = dict(NOAH, question=NOAH["question"].replace("36 crayons", "2 crayons"), program=NOAH["program"].replace("= 36", "= 2"))
    assert removes_needed(same_value, distractor_dropped.replace("36", "2")) is False  # a distractor equal to a needed number: still answerable
    kept, rejected = bogus_questions([NOAH] * 30, [random.Random(s) for s in range(30)])
    assert len(kept) + rejected == 30 and 0 < rejected < 30  # unanswerable drops one of 3 later sentences with numbers at random
    assert all("36 crayons" in k for k in kept)  # every kept question lost a needed sentence, never the distractor


@pytest.mark.parametrize("claim_id, experiment, control, verdict", [
    ("phi4.refusal_sft", [1, 0] * 20, [1, 0] * 20, "inconclusive"),  # identical arms: zero effect
    ("phi4.refusal_sft", [1] * 30 + [0] * 10, [1] * 5 + [0] * 35, "reproduced"),
    ("phi4.refusal_dpo_stage1", [0, 1] * 20, [0, 1] * 20, "inconclusive"),
    ("phi4.refusal_dpo_stage1", [1] * 5 + [0] * 35, [1] * 30 + [0] * 10, "reproduced"),  # direction -1: fewer not attempted
    ("phi4.refusal_not_attempted", [1] * 5 + [0] * 35, [1] * 30 + [0] * 10, "contradicted"),
    ("phi4.refusal_correct", [1, 1, 0, 0] * 10, [1, 1, 0, 0] * 10, "inconclusive"),
])
def test_the_refusal_findings_flip_with_planted_scores(claim_id, experiment, control, verdict):
    "Each reworked comparison through the ledger: equal arms give exactly 0 and inconclusive; a planted gap gives its verdict."
    from slm_bench.core.claims import claim
    from slm_bench.evals.findings import Finding

    finding = Finding.paired("planted", claim(claim_id), "experiment", "control", (experiment, control))
    assert finding.verdict == verdict
    assert finding.effect["difference"] == pytest.approx((sum(experiment) - sum(control)) / len(experiment))
    if experiment == control:
        assert (finding.effect["difference"], finding.effect["ci_low"], finding.effect["ci_high"]) == (0.0, 0.0, 0.0)
