"""Llama 2's contamination analysis: skipgram matching on small strings by hand and against brute force, planted copies found, the Z-test by hand,
lengths with small subsets skipped, and the planted gain over its replay-only control flipping the verdict."""
import math
import random

import pytest

from slm_bench.core.errors import BadInput
from slm_bench.evals.contamination import (NgramIndex, contaminated_reference, contaminated_tokens, contamination_by_length, contamination_percent,
                                           contamination_subsets, contamination_verdict, dirty_gain_ci, match_length, subset_z)


def test_skipgram_matching_on_small_strings_by_hand():
    # head 10 exact, then mismatches allowed within the budget; the span ends at the last agreeing token
    corpus = list(range(100, 130))
    sample = list(range(100, 112)) + [0] + list(range(113, 116)) + [1, 2, 3]
    assert match_length(sample, 0, corpus, 0, head=10, budget=4) == 16  # 12 agree, one skip, 3 agree; then 3 misses end it (trailing)
    assert match_length(sample, 0, corpus, 0, head=10, budget=0) == 12
    early = list(range(100, 105)) + [0] + list(range(106, 120))
    assert match_length(early, 0, corpus, 0, head=10, budget=4) == 0  # a mismatch in the first 10 tokens: no match
    flags = contaminated_tokens(sample, NgramIndex([corpus], head=10), min_length=10, budget=4)
    assert flags == [True] * 16 + [False] * 3  # the skipped token inside the span counts; the trailing tail does not
    assert contaminated_tokens(sample, NgramIndex([corpus], head=10), min_length=16, budget=4) == [False] * 19  # "longer than" 16: no


def test_the_index_agrees_with_brute_force():
    rng = random.Random(3)
    for trial in range(40):
        corpus = [rng.randrange(5) for _ in range(60)]
        sample = [rng.randrange(5) for _ in range(25)]
        at = rng.randrange(10)
        sample[at:at + 12] = corpus[trial:trial + 12]
        for budget in (0, 1, 3):
            assert contaminated_tokens(sample, NgramIndex([corpus], head=4), min_length=6, budget=budget) == \
                contaminated_reference(sample, corpus, min_length=6, head=4, budget=budget), (trial, budget)


def test_planted_copies_are_found_and_fresh_text_is_clean():
    rng = random.Random(0)
    corpus = [[rng.randrange(1000) for _ in range(200)] for _ in range(50)]
    planted = [doc[20:80] for doc in corpus[:10]]  # evaluation samples copied from training documents
    planted[0][30] = 5000  # one with a skip in the middle
    fresh = [[rng.randrange(1000) for _ in range(60)] for _ in range(10)]
    percents = contamination_percent(planted + fresh, NgramIndex(corpus, head=10))
    assert percents[:10] == [100.0] * 10 and percents[10:] == [0.0] * 10


def test_the_z_test_by_hand():
    # twenty samples, ten right (μ = 0.5, σ = 0.5): nine right ones dirty, nine wrong ones clean, one of each at 50%
    metric = [1.0] * 10 + [0.0] * 10
    percents = [90.0] * 9 + [50.0, 50.0] + [5.0] * 9
    verdict = contamination_verdict(metric, percents)
    # Z_n = (X̄ − μ_n) / σ_n with μ_n = μ, σ_n = σ/√n (the paper's sampling distribution of a mean of n)
    assert verdict["dirty"]["z"] == pytest.approx(3.0) and verdict["clean"]["z"] == pytest.approx(-3.0)  # 0.5 / (0.5 / 3)
    assert verdict["not clean"]["z"] == pytest.approx(9 / math.sqrt(11)) and verdict["not dirty"]["z"] == pytest.approx(-9 / math.sqrt(11))
    assert [verdict[s]["n"] for s in ("clean", "not clean", "not dirty", "dirty")] == [9, 11, 11, 9]
    assert verdict["affects"] is True
    # one subset with |Z| <= 2 is enough for "no effect": dirty 5 of 9 right, Z = (5/9 − 1/2) / (0.5/3) = 1/3
    weak = contamination_verdict([1.0] * 5 + [0.0] * 4 + [1.0, 0.0] + [0.0] * 5 + [1.0] * 4, percents)
    assert weak["dirty"]["z"] == pytest.approx(1 / 3) and weak["affects"] is False
    assert subset_z(metric, []) == {"n": 0, "mean": None, "z": None}
    assert subset_z(metric, list(range(20)))["z"] == pytest.approx(0.0)  # the whole set is its own mean
    assert subset_z([1.0] * 4, [0, 1])["z"] is None  # no spread: undefined
    assert contamination_subsets([10.0, 20.0, 79.9, 80.0]) == {"clean": [0], "not clean": [1, 2, 3], "not dirty": [0, 1, 2], "dirty": [3]}
    with pytest.raises(BadInput, match="one metric value per sample"):
        contamination_verdict([1.0], [])
    assert math.isclose(subset_z([1.0, 0.0, 0.0, 0.0], [0])["z"], (1 - 0.25) / math.sqrt(0.1875 / 1))


def test_a_length_whose_subset_is_under_min_subset_is_skipped_not_judged():
    metric = [1.0] * 10 + [0.0] * 10
    at_10 = [90.0] * 9 + [50.0, 50.0] + [5.0] * 9  # subsets 9, 11, 11, 9: the rule fires
    at_40 = [5.0] * 19 + [90.0]  # one dirty sample: its Z alone is (1 − 0.5)/0.5 = 1, and the clean subset is 19
    out = contamination_by_length(metric, {10: at_10, 40: at_40}, min_subset=9)
    assert sorted(out["tested"]) == [10] and out["skipped"] == {40: {"clean": 19, "not clean": 1, "not dirty": 19, "dirty": 1}}
    assert out["affecting"] == [10] and out["largest_affecting"] == 10
    assert contamination_by_length(metric, {10: at_10, 40: at_40}, min_subset=10)["tested"] == {}  # 9 < 10 at L = 10 too
    assert contamination_by_length(metric, {10: at_10}, min_subset=10)["largest_affecting"] is None
    # a planted case that used to fire on a one-problem subset: a lone wrong clean problem among right ones
    lone = contamination_by_length([1.0] * 19 + [0.0], {40: [90.0] * 19 + [5.0]}, min_subset=2)
    assert lone["tested"] == {} and lone["skipped"][40]["clean"] == 1


def test_the_planted_gain_flips_with_the_copies_and_is_zero_against_itself():
    from slm_bench.core.claims import claim
    from slm_bench.evals.findings import Finding

    percents = [95.0] * 30 + [5.0] * 30
    control = [1.0, 0.0] * 30
    planted = [1.0] * 30 + [1.0, 0.0] * 15  # the copies make every dirty problem right, the clean ones unchanged
    rule = claim("llama2.contamination_z_rule")
    same = dirty_gain_ci(control, control, percents)
    assert (same["difference"], same["ci_low"], same["ci_high"]) == (0.0, 0.0, 0.0)
    assert Finding("z", rule, "SFT + replay", "SFT + replay", effect=same).verdict == "inconclusive"
    gain = dirty_gain_ci(planted, control, percents)
    assert gain["difference"] == pytest.approx(0.5) and (gain["n_dirty"], gain["n_clean"]) == (30, 30)
    assert Finding("z", rule, "SFT + planted", "SFT + replay", effect=gain).verdict == "reproduced"
    hurt = dirty_gain_ci(control, planted, percents)  # the copies made the dirty problems worse
    assert Finding("z", rule, "SFT + planted", "SFT + replay", effect=hurt).verdict == "contradicted"


def test_the_control_is_the_contaminating_fine_tune_less_exactly_the_planted_copies():
    from slm_bench.methods.safety_distillation import replay_control

    rng = random.Random(0)
    test = [{"question": f"T{i}?", "program": f"t{i}", "answer": i} for i in range(40)]
    curated = [{"question": f"C{i}?", "program": f"c{i}"} for i in range(200)]
    planted = [test[i] for i in sorted(rng.sample(range(40), 10))]
    records = planted + rng.sample(curated, 25)  # as the stage builds them
    control = replay_control(records, planted)
    assert (len(records), len(control)) == (35, 25)
    assert control == records[10:] and not {r["question"] for r in control} & {r["question"] for r in planted}
