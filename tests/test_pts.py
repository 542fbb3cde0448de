"""Pivotal Token Search: exact answers on a chain with planted pivots, a real tiny model against a brute-force scan, the memo on disk."""
import json
import math
import re

import pytest

from slm_bench.methods.chain_world import ChainOracle, ChainSampler, ChainWorld, planted_pivots
from slm_bench.core.errors import BadInput
from slm_bench.methods.pts import (Estimator, PTSConfig, Question, SolutionSearch, build_pairs, pair_records, pivotal_token_search,
                                   scan_every_prefix, search_all, subdivide, trl_records)
from slm_bench.methods.pts_memo import ProbabilityMemo
from slm_bench.methods.pts_stats import PrefixStats, clopper_pearson, compare, direction

SYMBOLS = "ab+-dABCDEF"
FILLER = {"a": (0.7, 0), "b": (0.3, 0)}


def _steps(special, length=12):
    return [special.get(i, FILLER) for i in range(length)]


# Every exact step is either >= 0.45 or <= 0.1 away from zero, so with 256 rollouts the planted pivots are far from p_gap = 0.2.
WORLDS = {
    "A": ChainWorld(_steps({4: {"+": (0.5, 2), "-": (0.5, -2)}, 8: {"a": (0.9, 0), "d": (0.1, -1)}}), 1),  # one pivot; a no-op rare token
    "B": ChainWorld(_steps({2: {"+": (0.9, 2), "-": (0.1, -2)}, 7: {"+": (0.9, 2), "-": (0.1, -2)}}), 3),  # '+' moves p by 0.09 / 0.1: not pivotal
    "C": ChainWorld(_steps({3: {"+": (0.5, 2), "-": (0.5, -2)}, 8: {"a": (0.9, 0), "d": (0.1, -3)}}), 0),  # a rare late pivot
    "D": ChainWorld(_steps({}), 0),  # always right
    "E": ChainWorld(_steps({}), 5),  # always wrong
    "F": ChainWorld(_steps({5: {"+": (0.95, 2), "-": (0.05, -2)}}), 1),  # p = 0.95: outside [0.2, 0.8]
}


@pytest.fixture
def chain():
    sampler = ChainSampler(WORLDS, SYMBOLS)
    questions = [Question(name, [1, SYMBOLS.index(name) + 2]) for name in WORLDS]
    return sampler, ChainOracle(sampler), questions


def _config(**kw):
    return PTSConfig(**{"rollouts": 256, "max_new_tokens": 20, "solutions_per_question": 4, "question_range": (0.2, 0.85), **kw})


def test_the_chain_knows_its_probabilities(chain):
    sampler, _, _ = chain
    tok = sampler.tokenizer
    ids = lambda text: [SYMBOLS.index(c) + 2 for c in text]
    assert WORLDS["A"].p(tok, []) == pytest.approx(0.5)
    assert WORLDS["A"].p(tok, ids("aaaa+")) == 1.0 and WORLDS["A"].p(tok, ids("aaaa-")) == 0.0
    assert WORLDS["B"].p(tok, []) == pytest.approx(0.81) and WORLDS["B"].p(tok, ids("aa+")) == pytest.approx(0.9)
    assert WORLDS["C"].p(tok, ids("aaa+")) == pytest.approx(0.9) and WORLDS["C"].p(tok, ids("aaa+aaaad")) == 0.0


@pytest.mark.parametrize("adaptive", [False, True])
def test_pts_finds_exactly_the_planted_pivots(chain, adaptive):
    sampler, oracle, questions = chain
    result = pivotal_token_search(sampler, oracle, questions, _config(adaptive=adaptive))
    assert result.counts["all_right"] == 1 and result.counts["all_wrong"] == 1  # D and E: skipped, counted
    assert result.counts["out_of_range"] == 1  # F
    assert {s.question.id for s in result.searches} == {"A", "B", "C"}
    assert len(result.searches) == 12
    for search in result.searches:
        planted = planted_pivots(sampler, search.question, search.tokens, 0.2)
        assert [p.position for p in search.pivots] == [i for i, _ in planted], sampler.tokenizer.decode(search.tokens)
        for pivot, (_, exact_delta) in zip(search.pivots, planted):
            if adaptive:  # decided on as few as 16 rollouts: the interval it rested on holds the exact change
                assert pivot.delta_low <= exact_delta <= pivot.delta_high and abs(pivot.delta_low) >= 0.2
            else:
                assert pivot.delta == pytest.approx(exact_delta, abs=0.15)
    assert result.counts["pivots"] >= 6


def test_adaptive_estimation_uses_fewer_rollouts_for_the_same_pivots(chain):
    sampler, oracle, questions = chain
    fixed = pivotal_token_search(sampler, oracle, questions, _config(adaptive=False))
    adaptive = pivotal_token_search(sampler, oracle, questions, _config())
    assert [[p.position for p in s.pivots] for s in fixed.searches] == [[p.position for p in s.pivots] for s in adaptive.searches]
    search_rollouts = lambda r: r.counts["rollouts_sampled"] - r.counts["rollouts_sampled_pairs"]
    assert search_rollouts(adaptive) < 0.7 * search_rollouts(fixed)  # 6672 against 10544 with seed 0
    assert adaptive.counts["adaptive_decisions_early"] > 0 and fixed.counts["adaptive_decisions_early"] == 0


def test_breadth_first_search_equals_the_recursive_subdivide(chain):
    "The paper's recursion, run on the same memoised estimates, gives the same segments (and never needs a new estimate)."
    sampler, oracle, questions = chain
    result = pivotal_token_search(sampler, oracle, questions, _config(rollouts=64, adaptive=False))
    memo = result.estimator.memo

    for search in result.searches:
        def p(prefix, search=search):
            stats = memo.known(search.question.id, search.question.prompt_ids + list(prefix))
            assert stats is not None and stats.trials, f"the recursion needs p at prefix {len(prefix)}, which the search never estimated"
            return stats.p

        def split(prefix, t, search=search):
            m = search.split_point(len(prefix), len(prefix) + len(t), "logprob") - len(prefix)
            return t[:m], t[m:]

        segments, start = [], 0
        for t in subdivide(p, (), tuple(search.tokens), 0.2, split):
            segments.append((start, start + len(t)))
            start += len(t)
        assert [(i, j) for i, j, _, _ in search.leaves] == segments


def test_pairs_follow_phi4(chain):
    "Accepted raises p(success | prefix), rejected lowers it — in the chain's exact p, and in the fresh estimates the pair records."
    sampler, oracle, questions = chain
    result = pivotal_token_search(sampler, oracle, questions, _config())
    assert result.pairs and result.counts["pairs"] + result.counts["pivots_without_pair"] == result.counts["pivots"]
    assert result.counts["pivots_without_pair"] == result.counts["pivots_not_confirmed"] + result.counts["pivots_without_alternative"]
    assert result.counts["rollouts_sampled_pairs"] == result.fresh.rollouts_sampled > 0
    searches = {(s.question.id, tuple(s.question.prompt_ids + s.tokens[:p.position])): (s, p) for s in result.searches for p in s.pivots}
    for pair in result.pairs:
        search, pivot = searches[(pair.question_id, tuple(pair.prompt_ids))]
        assert pair.prompt_ids == search.question.prompt_ids + search.tokens[:pivot.position]  # Q + prefix, as ids
        fresh = lambda extra: result.fresh.stats(search.question, search.tokens[:pivot.position] + extra).p
        assert (pair.p_chosen, pair.p_prefix, pair.p_rejected) == (fresh([pair.chosen]), fresh([]), fresh([pair.rejected]))
        assert pair.p_chosen > pair.p_prefix > pair.p_rejected
        if pivot.delta > 0:
            assert pair.chosen == pivot.token and pair.pivot_is == "chosen"
        else:
            assert pair.rejected == pivot.token and pair.pivot_is == "rejected"
        alternative = pair.rejected if pair.pivot_is == "chosen" else pair.chosen
        assert alternative in result.estimator.stats(search.question, search.tokens[:pivot.position]).next_tokens  # drawn in its rollouts
        world = WORLDS[pair.question_id]
        exact = lambda tokens: world.p(sampler.tokenizer, pair.prompt_ids[2:] + tokens)
        assert exact([pair.chosen]) > exact([]) > exact([pair.rejected])
    records = pair_records(result.pairs, sampler.tokenizer)
    assert records[0]["chosen_ids"] == [result.pairs[0].chosen] and records[0]["chosen_text"] in SYMBOLS
    assert set(trl_records(records)[0]) == {"prompt", "chosen", "rejected"}


def test_an_alternative_that_also_raises_p_is_never_rejected():
    """The old rule's failure: pivot '+' raises p 0.445 -> 0.9; 'A', the most frequent alternative, raises it too (0.6), yet
    0.9 - 0.6 >= p_gap made it "rejected". The paper's rule needs a rejected token that lowers p: 'd' (0.1)."""
    symbols = "a+AdBCDEQ"
    flat = {"a": (1.0, 0)}
    world = ChainWorld([flat, flat, {"+": (0.15, 2), "A": (0.45, 1), "d": (0.4, 0)}, flat, flat, flat,
                        {"B": (0.1, 3), "C": (0.5, 2), "D": (0.3, 1), "E": (0.1, 0)}, flat], threshold=3)
    sampler = ChainSampler({"Q": world}, symbols)
    tok, ids = sampler.tokenizer, lambda text: [symbols.index(c) + 2 for c in text]
    assert [round(world.p(tok, ids("aa" + c)), 3) for c in "+Ad"] + [round(world.p(tok, ids("aa")), 3)] == [0.9, 0.6, 0.1, 0.445]
    question = Question("Q", [1, symbols.index("Q") + 2])
    config = PTSConfig(max_new_tokens=12, alternatives=3)
    t_full = ids("aa+aaaCa") + [0]
    search = SolutionSearch(question, t_full, [0.0] * len(t_full), True)
    estimator, fresh = Estimator(sampler, ChainOracle(sampler), config), Estimator(sampler, ChainOracle(sampler), config.fresh())
    estimator.set_exact([(question, t_full)])
    search_all([search], estimator, config)
    assert [p.position for p in search.pivots] == [2]  # '+' (0.445 -> 0.9); 'C' then moves p by 0.1 only
    seen = estimator.stats(question, t_full[:2]).next_tokens
    assert max(seen, key=lambda t: seen[t][0]) == ids("A")[0]  # 'A' is the most frequent alternative
    pairs, unpaired = build_pairs([search], estimator, config, fresh)
    at_two = next(p for p in pairs if p.position == 2)
    assert (tok.decode([at_two.chosen]), tok.decode([at_two.rejected])) == ("+", "d")
    assert unpaired == {"pivots_not_confirmed": 0, "pivots_without_alternative": 0}


def test_split_points():
    search = SolutionSearch(Question("q", [1]), [5, 6, 7, 8, 9, 10], [-0.01, -3.0, -0.01, -0.01, -1.0, -1.0], True)
    # surprisal 0.01, 3, 0.01, 0.01, 1, 1: total 5.03, half 2.515 is reached after the second token
    assert search.split_point(0, 6, "logprob") == 2
    assert search.split_point(2, 6, "logprob") == 5  # 0.01, 0.01, 1 | 1 : half of 2.02 is reached at the fifth token
    assert search.split_point(0, 6, "index") == 3
    assert search.split_point(0, 2, "logprob") == 1  # both halves non-empty
    certain = SolutionSearch(Question("q", [1]), [5, 6, 7, 8], [0.0] * 4, True)
    assert certain.split_point(0, 4, "logprob") == 2  # no surprisal at all: the middle


def test_clopper_pearson_and_the_decision_rule():
    assert clopper_pearson(0, 20, 0.1) == (0.0, pytest.approx(1 - 0.05 ** (1 / 20)))
    lo, hi = clopper_pearson(3, 10, 0.05)
    assert lo == pytest.approx(0.066739, abs=1e-5) and hi == pytest.approx(0.652453, abs=1e-5)  # textbook values
    level = PTSConfig().level()  # delta 0.05 over the looks 16, 32, 64, 128, 256 (and 512, 1024 for single tokens)
    assert level == pytest.approx(0.05 / 7)
    assert compare(PrefixStats(6, 6), PrefixStats(6, 0), 0.2, level) == "open"  # 6 vs 6 cannot settle it yet
    assert compare(PrefixStats(32, 32), PrefixStats(32, 0), 0.2, level) == "above"
    assert compare(PrefixStats(64, 32), PrefixStats(64, 33), 0.2, level) == "open"
    assert compare(PrefixStats(256, 128), PrefixStats(256, 131), 0.2, level) == "below"
    assert compare(PrefixStats(1, 1, exact=True), PrefixStats(1, 1, exact=True), 0.2, level) == "below"
    assert compare(PrefixStats(16, 8), PrefixStats(16, 12), 0.2) == "above"  # 0.25 >= 0.2 on the point estimates
    assert compare(PrefixStats(16, 8), PrefixStats(16, 11), 0.2) == "below"
    assert direction(PrefixStats(64, 32), PrefixStats(64, 50), level) == "up"
    assert direction(PrefixStats(64, 32), PrefixStats(64, 36), level) == "open"


def test_adaptive_error_rate_is_at_most_delta():
    "Brute force on the test: simulated comparisons, many near the p_gap edge, run through the looks; decisions are wrong at most δ of the time."
    import random

    rng = random.Random(0)
    config = PTSConfig(delta=0.1)
    wrong = decided = undecided = 0
    for trial in range(300):
        pa = rng.choice([0.0, 0.03, 0.1, 0.5, 0.9, 0.97, 1.0])
        pb = min(1.0, max(0.0, pa + rng.choice([-1, 1]) * rng.choice([0.0, 0.05, 0.15, 0.25, 0.35, 0.8])))
        a, b = PrefixStats(), PrefixStats()
        for _ in range(config.rollouts):
            a.add([5], rng.random() < pa, True, 0)
            b.add([5], rng.random() < pb, True, 0)
        decision = "open"
        for n in config.looks():
            decision = compare(a.first(n), b.first(n), config.p_gap, config.level())
            if decision != "open":
                break
        if decision == "open":
            undecided += 1
            continue
        decided += 1
        wrong += decision != ("above" if abs(pb - pa) >= 0.2 else "below")
    assert decided > 200 and wrong / decided <= 0.1, (decided, wrong, undecided)


def test_two_estimates_at_n16_of_the_same_p_differ_by_p_gap_a_fifth_of_the_time():
    "The issue's arithmetic, exactly: X, Y ~ Binomial(16, 0.5); P(|X - Y| / 16 >= 0.2) = 0.2153."
    pmf = [math.comb(16, k) / 2**16 for k in range(17)]
    assert sum(pmf[a] * pmf[b] for a in range(17) for b in range(17) if abs(a - b) >= 4) == pytest.approx(0.21533, abs=1e-5)


def test_the_sequential_test_reports_no_noise_pivots_where_n16_does():
    "Ten free choices that leave p at 0.5, then a coin: every pivot but the coin is noise. N = 16 finds noise; the default test does not."
    symbols = "ab+-Q"
    free, coin = {"a": (0.5, 0), "b": (0.5, 0)}, {"+": (0.5, 1), "-": (0.5, -1)}
    sampler = ChainSampler({"Q": ChainWorld([free] * 10 + [coin], threshold=1)}, symbols)
    question = Question("Q", [1, symbols.index("Q") + 2])
    noisy, careful = (pivotal_token_search(sampler, ChainOracle(sampler), [question],
                                           PTSConfig(max_new_tokens=14, solutions_per_question=8, alternatives=0, **kw))
                      for kw in ({"rollouts": 16, "adaptive": False}, {}))
    assert [len(s.tokens) for s in noisy.searches] == [12] * 8  # the same eight solutions: 11 symbols and EOS
    false = lambda r: [(s.tokens, p.position) for s in r.searches for p in s.pivots if p.position != 10]
    assert len(false(noisy)) >= 3 and false(careful) == []
    assert [p.position for p in careful.pivots] == [10] * 8  # the coin, in every solution


def test_cheap_discovery_then_confirmation_drops_exactly_the_noise_pivots():
    """The same world: Subdivide on 16-rollout point estimates finds the coin and six noise steps; re-deciding each on fresh
    rollouts by the sequential test keeps the eight coins alone, each with an interval beyond p_gap, for fewer rollouts."""
    symbols = "ab+-Q"
    free, coin = {"a": (0.5, 0), "b": (0.5, 0)}, {"+": (0.5, 1), "-": (0.5, -1)}
    sampler = ChainSampler({"Q": ChainWorld([free] * 10 + [coin], threshold=1)}, symbols)
    question = Question("Q", [1, symbols.index("Q") + 2])
    noisy, cheap, careful = (pivotal_token_search(sampler, ChainOracle(sampler), [question],
                                                  PTSConfig(max_new_tokens=14, solutions_per_question=8, alternatives=0, **kw))
                             for kw in ({"rollouts": 16, "adaptive": False}, {"discovery_rollouts": 16}, {}))
    assert [s.tokens for s in cheap.searches] == [s.tokens for s in noisy.searches]  # the same eight solutions
    assert noisy.counts["pivots"] == 14 and cheap.counts["pivots_dropped_on_fresh"] == 6  # 14 found at N = 16, 6 of them noise
    assert [p.position for p in cheap.pivots] == [10] * 8  # the coin, in every solution
    assert all(p.delta_low >= 0.2 for p in cheap.pivots)  # each kept on the confirmation's interval
    assert (cheap.counts["rollouts_sampled"], careful.counts["rollouts_sampled"]) == (4208, 9376)  # seed 0
    assert cheap.counts["rollouts_sampled_confirm"] == 3520 and cheap.counts["rollouts_sampled_pairs"] == 0


def test_reference_quality_on_the_chain_world(chain):
    "The reference finds exactly the planted pivots of every searched solution; PTS's precision is 1 and its recall is what it found."
    from slm_bench.methods.pts_quality import QualityConfig, pivot_key, pivot_quality, reference_pivots

    sampler, oracle, questions = chain
    result = pivotal_token_search(sampler, oracle, questions, _config(alternatives=0))
    qc = QualityConfig(scan_rollouts=64, confirm_rollouts=512)
    reference = reference_pivots(result.searches, qc.estimator(sampler, oracle, result.config), 0.2, qc)
    planted = {pivot_key(s.question.id, s.tokens, i) for s in result.searches for i, _ in planted_pivots(sampler, s.question, s.tokens, 0.2)}
    assert set(reference["pivots"]) == planted
    quality = pivot_quality([(s, p) for s in result.searches for p in s.pivots], result.searches, qc.estimator(sampler, oracle, result.config), 0.2, qc, reference)
    found = {pivot_key(p.question_id, s.tokens, p.position) for s in result.searches for p in s.pivots}
    assert quality["precision"]["value"] == 1.0 and quality["false_pivots"] == []
    assert (quality["recall"]["hits"], quality["recall"]["total"]) == (len(found & planted), len(planted))
    assert quality["recall"]["ci"][0] <= quality["recall"]["value"] <= quality["recall"]["ci"][1]


def test_memo_is_reused_and_corruption_is_detected(chain, tmp_path):
    sampler, oracle, questions = chain
    config = _config(rollouts=32)
    path = tmp_path / "memo.jsonl"
    fingerprint = {"model": "chain", **config.estimate_fingerprint(), "oracle": oracle.name}
    fresh_path, fresh_fingerprint = tmp_path / "fresh.jsonl", {**fingerprint, **config.fresh().estimate_fingerprint()}
    first = pivotal_token_search(sampler, oracle, questions, config, memo=ProbabilityMemo(path, fingerprint),
                                 fresh_memo=ProbabilityMemo(fresh_path, fresh_fingerprint))
    assert first.counts["rollouts_sampled"] > first.counts["rollouts_sampled_pairs"] > 0
    again = pivotal_token_search(sampler, oracle, questions, config, memo=ProbabilityMemo(path, fingerprint),
                                 fresh_memo=ProbabilityMemo(fresh_path, fresh_fingerprint))
    assert again.counts["rollouts_sampled"] == 0  # every estimate, the pairs' too, came from the memos
    assert [(p.chosen, p.rejected, p.p_chosen) for p in again.pairs] == [(p.chosen, p.rejected, p.p_chosen) for p in first.pairs]
    assert [[p.position for p in s.pivots] for s in again.searches] == [[p.position for p in s.pivots] for s in first.searches]

    lines = path.read_text().splitlines()
    tampered = json.loads(lines[3])
    tampered["stats"]["successes"] = 0  # a plausible-looking edit: only the line's hash gives it away
    lines[3] = json.dumps(tampered)
    path.write_text("\n".join(lines) + "\n")
    with pytest.warns(UserWarning, match="line 4 does not match its hash"):
        memo = ProbabilityMemo(path, fingerprint)
    assert memo.entries == {} and (tmp_path / "memo.jsonl.corrupt").exists()
    rebuilt = pivotal_token_search(sampler, oracle, questions, config, memo=memo)
    assert rebuilt.counts["rollouts_sampled"] - rebuilt.counts["rollouts_sampled_pairs"] == first.counts["rollouts_sampled"] - first.counts["rollouts_sampled_pairs"]
    assert [[p.position for p in s.pivots] for s in rebuilt.searches] == [[p.position for p in s.pivots] for s in first.searches]

    path.write_text(path.read_text()[:-40])  # a torn last line
    with pytest.warns(UserWarning, match="unreadable|hash"):
        assert ProbabilityMemo(path, fingerprint).entries == {}
    with pytest.warns(UserWarning, match="different model"):
        ProbabilityMemo(tmp_path / "memo.jsonl.corrupt", {**fingerprint, "model": "another"})


def test_too_long_solutions_are_skipped(chain):
    sampler, oracle, questions = chain
    sampler.max_context = 10  # prompt (2) + solution (13) does not fit
    result = pivotal_token_search(sampler, oracle, questions[:3], _config(rollouts=32))
    assert result.searches == [] and result.counts["too_long"] > 0


def test_bad_settings_are_clear_errors(chain):
    sampler, oracle, questions = chain
    with pytest.raises(BadInput, match="split"):
        PTSConfig(split="middle")
    with pytest.raises(BadInput, match="p_gap"):
        PTSConfig(p_gap=0)
    with pytest.raises(BadInput, match="unique"):
        pivotal_token_search(sampler, oracle, questions[:1] * 2, _config(rollouts=8))


# -- a real (tiny) model ---------------------------------------------------------------------------------------

class ApplesOracle:
    "Correct when the model finishes a well-formed 'Tom has a apples and buys b more, so he has c apples.' with c < 20."
    name = "apples"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def judge(self, items):
        out = []
        for question, ids in items:
            text = self.tokenizer.decode(question.prompt_ids + ids, skip_special_tokens=True)
            m = re.search(r"Tom has (\d+) apples and buys (\d+) more, so he has (\d+) apples\.", text)
            out.append(bool(m) and int(m[3]) < 20)
        return out


def test_on_a_tiny_model_every_reported_pivot_is_pivotal_in_a_brute_force_scan(tiny_checkpoint):
    from slm_bench.infer.sampling import HFSampler

    sampler = HFSampler.from_checkpoint(tiny_checkpoint)
    tok = sampler.tokenizer
    oracle = ApplesOracle(tok)
    questions = [Question(str(a), tok(f"Tom has {a} apples and buys")["input_ids"]) for a in range(8, 22)]
    config = PTSConfig(rollouts=48, max_new_tokens=24, adaptive=False)  # the paper's plain rule, so a plain scan can repeat it
    result = pivotal_token_search(sampler, oracle, questions, config)
    assert len(result.searches) >= 5 and result.counts["pivots"] >= 5
    # the same rollouts, drawn prefix by prefix: the batched, memoised search agrees with a plain scan exactly
    same_n, _ = scan_every_prefix(sampler, oracle, result.searches, 48, config)
    for search, scan in zip(result.searches, same_n):
        assert set(p.position for p in search.pivots) <= set(scan.pivots)
        for pivot in search.pivots:
            assert scan.p[pivot.position] == pivot.p_before and scan.p[pivot.position + 1] == pivot.p_after
    # many more rollouts per prefix: every reported pivot is pivotal within sampling error
    scans, _ = scan_every_prefix(sampler, oracle, result.searches, 256, config)
    for search, scan in zip(result.searches, scans):
        for pivot in search.pivots:
            def se(p, n):
                return math.sqrt(max(p * (1 - p), 1 / n) / n)
            i = pivot.position
            slack = 3 * math.sqrt(se(pivot.p_before, pivot.rollouts_before) ** 2 + se(pivot.p_after, pivot.rollouts_after) ** 2
                                  + se(scan.p[i], scan.trials[i]) ** 2 + se(scan.p[i + 1], scan.trials[i + 1]) ** 2)
            assert abs(scan.p[i + 1] - scan.p[i]) >= 0.2 - slack, (tok.decode(search.tokens), i)
            assert (scan.p[i + 1] - scan.p[i]) * pivot.delta > 0  # same direction
    searched_rollouts = sum(result.estimator.stats(s.question, s.tokens[:i]).trials
                            for s in result.searches for i in range(len(s.tokens)) if i)  # prefixes beyond the screening
    brute_same_n = sum(48 for s in result.searches for i in range(1, len(s.tokens)))
    print(f"searches {len(result.searches)}, pivots {result.counts['pivots']}, rollouts beyond screening: PTS {searched_rollouts}, every prefix {brute_same_n}")
    assert searched_rollouts * 2 <= brute_same_n  # far fewer than scanning every prefix at the same N


def test_probability_curve_widget_and_figure(chain):
    "The view built from a real search: records survive JSON, the widget follows its controls, the static figure draws."
    import json as _json

    import matplotlib
    matplotlib.use("agg")
    from slm_bench.methods.pts_view import PTSCurveWidget, curve_points, curves_figure, rollouts_html, search_records

    sampler, oracle, questions = chain
    result = pivotal_token_search(sampler, oracle, questions, _config(rollouts=64, adaptive=False))
    records = _json.loads(_json.dumps(search_records(result, sampler.tokenizer)))
    assert len(records) == len(result.searches)
    with_pivot = next(i for i, r in enumerate(records) if r["pivots"])
    record, search = records[with_pivot], result.searches[with_pivot]
    assert "".join(record["pieces"]) == sampler.tokenizer.decode(search.tokens)
    xs, ps = curve_points(record)
    assert xs[0] == 0 and xs[-1] == len(search.tokens) and all(0 <= p <= 1 for p in ps)
    pivot = record["pivots"][0]
    assert ps[xs.index(pivot["position"])] == pytest.approx(pivot["p_before"]) and ps[xs.index(pivot["position"] + 1)] == pytest.approx(pivot["p_after"])
    widget = PTSCurveWidget(records)
    widget.question.value = with_pivot
    assert widget.point.value == pivot["position"] and widget.point.max == len(record["pieces"])
    assert f"prefix of {pivot['position']} tokens" in widget.rollouts.value
    widget.point.value = pivot["position"] + 1
    assert f"p = {pivot['p_after']:.2f}" in widget.rollouts.value
    kept = result.estimator.stats(search.question, []).rollouts
    html = rollouts_html(record, 0)
    assert (html.count("✓"), html.count("✗")) == (sum(ok for _, ok, _ in kept), sum(not ok for _, ok, _ in kept))
    figure = curves_figure(records, limit=2)
    assert len(figure.axes) == 2 and "pivotal token" in figure.axes[0].get_title()
