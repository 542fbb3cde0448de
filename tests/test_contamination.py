"""Llama 2's contamination analysis: skipgram matching on small strings by hand and against brute force, planted copies found, the Z-test by hand."""
import math
import random

import pytest

from slm_bench.core.errors import BadInput
from slm_bench.evals.contamination import (NgramIndex, contaminated_reference, contaminated_tokens, contamination_percent, contamination_subsets,
                                           contamination_verdict, match_length, subset_z)


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
    metric = [1.0] * 4 + [0.0] * 6
    verdict = contamination_verdict(metric, [95.0] * 4 + [0.0] * 6)
    # μ 0.4, variance 0.24; dirty: (1 − 0.4) / sqrt(0.24 / 4 · 6 / 9) = 3
    assert verdict["dirty"]["z"] == pytest.approx(3.0) and verdict["clean"]["z"] == pytest.approx(-3.0)
    assert verdict["affects"] is True
    assert subset_z(metric, []) == {"n": 0, "mean": None, "z": None}
    assert subset_z(metric, list(range(10)))["z"] is None  # the whole set has no sampling spread
    assert contamination_subsets([10.0, 20.0, 79.9, 80.0]) == {"clean": [0], "not clean": [1, 2, 3], "not dirty": [0, 1, 2], "dirty": [3]}
    # half the dirty items wrong: the subsets do not differ beyond chance, no effect
    assert contamination_verdict([1.0, 0.0] * 5, [95.0] * 4 + [0.0] * 6)["affects"] is False
    with pytest.raises(BadInput, match="one metric value per sample"):
        contamination_verdict([1.0], [])
    assert math.isclose(subset_z([1.0, 0.0, 0.0, 0.0], [0])["z"], (1 - 0.25) / math.sqrt(0.1875 / 1 * 3 / 3))
