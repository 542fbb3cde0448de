"""The control for PTS → DPO (issue 54): single-token pairs at non-pivotal positions of the searched solutions, and the
finding PTS-DPO − control-DPO with planted arms."""
import pytest

from slm_bench.core.claims import claim
from slm_bench.evals.findings import Finding
from slm_bench.methods.pts import (ControlPair, Estimator, Pivot, PivotPair, PTSConfig, PTSResult, Question, SolutionSearch, control_pairs,
                                   non_pivotal_positions)

VOCAB = 32


def _search(question: Question, tokens: list[int], leaves: list[tuple], pivots: list[int], p: dict, estimator: Estimator) -> SolutionSearch:
    "A finished search by hand: its leaves (i, j, decision, rollouts), its confirmed pivots and the estimates of p it made."
    s = SolutionSearch(question, tokens, [-0.5] * len(tokens), True, leaves=leaves)
    s.pivots = [Pivot(question.id, k, tokens[k], p[k], p[k + 1], 0.3, 16, 16) for k in pivots]
    for i, value in p.items():
        stats = estimator.stats(question, s.prefix(i))
        stats.trials, stats.successes = 16, round(16 * value)
    return s


@pytest.fixture
def result():
    """Question A: Subdivide left [0, 3), [4, 8) and [9, 10) whole; 3 is a pivot; 8 was called pivotal and dropped on fresh
    rollouts (an 'above' leaf, no pivot); p = 0 from 10 on (the solution is wrong), so [9, 10) is not open.
    Question B: [0, 5) and [6, 8) whole, a pivot at 5; p = 1 from 6 on, so [6, 8) is not open."""
    estimator = Estimator(None, None, PTSConfig())
    qa, qb = Question("A", [1, 2]), Question("B", [1, 3])
    a = _search(qa, list(range(10, 20)), [(0, 3, "below", 16), (3, 4, "above", 16), (4, 8, "below", 16), (8, 9, "above", 16), (9, 10, "below", 16)],
                [3], {0: 0.5, 3: 0.5, 4: 0.9, 8: 0.9, 9: 0.25, 10: 0.0}, estimator)
    b = _search(qb, list(range(20, 28)), [(0, 5, "below", 16), (5, 6, "above", 16), (6, 8, "below", 16)],
                [5], {0: 0.375, 5: 0.4375, 6: 1.0, 8: 1.0}, estimator)
    pairs = [PivotPair("A", [1, 2, 10, 11, 12], 13, 5, 0.9, 0.1, 0.5, "chosen", 3),
             PivotPair("B", [1, 3, 20, 21, 22, 23, 24], 25, 6, 1.0, 0.2, 0.44, "chosen", 5)]
    return PTSResult(PTSConfig(), [a, b], pairs, {}, {}, estimator)


def _probs(favour_chosen: bool = True, alternative: float = 0.3):
    "Next-token probabilities: the solution's own next token (known from the prompt's last id) or token 0 likeliest, then token 1."
    def next_probs(ids: list[int]) -> list[float]:
        own = ids[-1] + 1 if ids[-1] >= 10 else (10 if ids[1] == 2 else 20)  # the solutions are runs of consecutive ids
        probs = [(1 - 0.6 - alternative) / (VOCAB - 2)] * VOCAB
        probs[own if favour_chosen else 0], probs[1] = 0.6, alternative
        return probs
    return next_probs


OPEN = {"A": {0, 1, 2, 4, 5, 6, 7}, "B": {0, 1, 2, 3, 4}}


def test_positions_are_in_unsplit_segments_and_never_pivots(result):
    a, b = result.searches
    assert [k for k, _ in non_pivotal_positions(a)] == [0, 1, 2, 4, 5, 6, 7, 9]  # 3 (pivot) and 8 (dropped, an 'above' leaf) never
    assert [k for k, _ in non_pivotal_positions(b)] == [0, 1, 2, 3, 4, 6, 7]
    assert [k for k, _ in non_pivotal_positions(a, result.estimator, open_only=True)] == sorted(OPEN["A"])
    assert [k for k, _ in non_pivotal_positions(b, result.estimator, open_only=True)] == sorted(OPEN["B"])


@pytest.mark.parametrize("seed", range(8))
def test_control_pairs_match_the_pts_pairs(result, seed):
    pairs = control_pairs(result, _probs(), seed=seed)
    assert len(pairs) == len(result.pairs) == 2
    assert [c.question_id for c in pairs] == ["A", "B"]  # spread like the PTS pairs: one per PTS pair's question
    searches = {s.question.id: s for s in result.searches}
    for c in pairs:
        s = searches[c.question_id]
        assert c.position in OPEN[c.question_id] and c.position not in {p.position for p in s.pivots}
        i, j = c.segment
        assert i <= c.position < j and (i, j, "below", 16) in s.leaves
        assert c.prompt_ids == list(s.question.prompt_ids) + s.tokens[:c.position]
        assert (c.chosen, c.rejected, c.prob_chosen, c.prob_rejected) == (s.tokens[c.position], 1, 0.6, 0.3)
        assert 0 < min(c.segment_p) and max(c.segment_p) < 1


def test_rejected_is_never_the_chosen_token(result):
    for c in control_pairs(result, _probs(favour_chosen=False), n=100):  # the solution's token is not the model's favourite here
        assert c.chosen != c.rejected == 0
    for c in control_pairs(result, _probs(alternative=0.0), n=100):  # ties among the rest: the smallest id, never the chosen one
        assert c.chosen != c.rejected and c.prob_rejected <= c.prob_chosen


def test_count_and_no_position_twice(result):
    every = control_pairs(result, _probs(), n=100, seed=3)
    assert len(every) == 12  # 7 open positions in A, 5 in B: fewer than n when they run out
    assert len({(c.question_id, c.position) for c in every}) == 12
    assert len(control_pairs(result, _probs(), n=100, open_only=False)) == 15  # + A's 9, B's 6 and 7
    assert len(control_pairs(result, _probs(), n=5)) == 5
    assert control_pairs(result, _probs(alternative=0.01), n=5, min_alternative=0.05) == []  # no real alternative anywhere


def test_pairs_train_like_pts_pairs(result):
    from dataclasses import asdict

    record = asdict(control_pairs(result, _probs(), seed=1)[0])
    assert isinstance(control_pairs(result, _probs())[0], ControlPair)
    assert {"question_id", "prompt_ids", "chosen", "rejected", "position"} <= set(record)


def test_the_finding_on_planted_arms():
    "PTS-DPO − control-DPO: identical arms give effect 0 (inconclusive); a better PTS arm reproduces, a worse one contradicts."
    def verdict(experiment, control):
        f = Finding.paired("phi4_pts_dpo_pass1", claim("phi4.pts_dpo"), "DPO on PTS pairs", "DPO on non-pivotal pairs", (experiment, control),
                           held_out_scores=(experiment[:40], control[:40]))
        return f.verdict, round(f.effect["difference"], 4), f.effect["n"], f.held_out["n"]

    control = [True, False] * 50
    assert verdict(control, control) == ("inconclusive", 0.0, 100, 40)
    assert verdict([True] * 100, control) == ("reproduced", 0.5, 100, 40)
    assert verdict([False] * 100, control) == ("contradicted", -0.5, 100, 40)
    assert verdict([True] * 51 + [False] * 49, control)[0] == "inconclusive"  # one problem apart: no claim either way
