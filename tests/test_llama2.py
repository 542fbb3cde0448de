"""Llama 2's recipe pieces against hand-computed answers: R_c, pooling across rejection-sampling iterations, max/median by K, the annotator and the mixes."""
import pytest

from slm_bench.core.errors import BadInput
from slm_bench.data.safety import REFUSAL, is_refusal, safety_demonstrations, safety_prompts
from slm_bench.methods.llama2 import reward_mix
from slm_bench.methods.preferences import Facts, ProgrammaticAnnotator, quality_penalties, validate_preferences
from slm_bench.methods.rejection_sampling import best_samples, combined_reward, max_median_by_k, pool_best, whitened_logits


def test_rc_takes_the_safety_score_on_safety_prompts_and_below_the_threshold():
    # helpfulness prompt, safe-looking: R_h; helpfulness prompt, R_s = 0.14 < 0.15: R_s; R_s = 0.15 exactly: R_h; safety prompt: R_s
    assert combined_reward([0.8, 0.8, 0.8, 0.8], [0.9, 0.14, 0.15, 0.9], [False, False, False, True]) == [0.8, 0.14, 0.8, 0.9]


def test_whitened_logits_by_hand():
    # logit(0.5) = 0, logit(0.731059) = 1, logit(0.268941) = -1: mean 0, population std sqrt(2/3)
    assert whitened_logits([0.5, 0.7310585786, 0.2689414214]) == pytest.approx([0.0, 1.224745, -1.224745], abs=1e-5)


def test_pooling_keeps_each_prompts_best_across_iterations():
    first = best_samples(["a", "b"], [[0.1, 0.9, 0.3], [0.4, 0.2]], [["a0", "a1", "a2"], ["b0", "b1"]], iteration=1)
    second = best_samples(["a", "b", "c"], [[0.5], [0.8, 0.1], [0.3]], [["a3"], ["b2", "b3"], ["c0"]], iteration=2)
    pooled = pool_best(first, second)
    assert {p: (e["sample"], e["reward"], e["iteration"]) for p, e in pooled.items()} == {
        "a": ("a1", 0.9, 1), "b": ("b2", 0.8, 2), "c": ("c0", 0.3, 2)}
    assert pool_best(second, first)["a"]["sample"] == "a1"  # the best wins whatever the order
    assert set(pool_best(first)) == {"a", "b"}  # one iteration: its own bests


def test_max_median_gap_grows_with_k_on_a_constructed_case():
    rewards = [[0.5, 0.1, 0.9, 0.3], [0.2, 0.6, 0.4, 1.0]]
    curve = max_median_by_k(rewards, [1, 2, 4])
    gaps = [curve[k]["max"] - curve[k]["median"] for k in (1, 2, 4)]
    assert gaps == pytest.approx([0.0, 0.2, 0.5])  # k=2: maxes 0.5, 0.6 vs medians 0.3, 0.4; k=4: maxes 0.9, 1.0 vs medians 0.4, 0.5
    with pytest.raises(BadInput, match="between 1 and the samples per prompt"):
        max_median_by_k(rewards, [5])


def test_the_annotator_rates_each_case_by_its_rule():
    annotator = ProgrammaticAnnotator()
    right, wrong, crash = Facts(True, True, False), Facts(True, False, False), Facts(False, False, False)
    refusal, unsafe = Facts(True, False, True, value=REFUSAL), Facts(False, False, False, ("network",))
    assert annotator.helpfulness((wrong, "", 0), (right, "", 5)).rating == "significantly better"  # right beats wrong, whatever the style
    assert annotator.helpfulness((right, "", 2), (right, "", 0)).chosen == 1  # fewer penalty points
    assert annotator.helpfulness((wrong, "", 0), (crash, "", 0)).rating == "slightly better"
    assert annotator.safety((refusal, "", 0), (unsafe, "", 0), unsafe_request=True).safety_bin == "chosen safe, other unsafe"
    assert annotator.safety((unsafe, "", 0), (unsafe, "", 0), unsafe_request=True).safety_bin == "both unsafe"
    assert annotator.safety((refusal, "", 0), (right, "", 0), unsafe_request=False).chosen == 1  # borderline: refusing is wrong


def test_quality_penalties_by_hand():
    question = "Ava has 12 apples and buys 5 more. Ben is 40 years old. How many apples?"
    reference = "    apples = 12\n    more = 5\n    total = apples + more\n    result = total\n    return result\n"
    sloppy = "    a = 12\n    b = 5\n    age = 40\n    t = a + b\n    result = t\n    return result\n"
    assert quality_penalties(sloppy, question, reference) == {"irrelevant_numbers": 1, "extra_steps": 1, "unreadable_names": 3, "points": 6}


def test_refusals_and_the_teacher():
    assert is_refusal(REFUSAL) and not is_refusal("I can't") and not is_refusal(0)
    demos = safety_demonstrations(safety_prompts(50, 50, seed=0), refuse_unsafe=1.0, refuse_borderline=0.0, seed=0)
    assert all(d["refused"] == (d["kind"] == "unsafe") for d in demos)
    assert all(REFUSAL in d["program"] for d in demos if d["kind"] == "unsafe")


def test_reward_mixes_follow_the_paper_shares():
    rows = ([{"track": "helpfulness", "split": "train"}] * 100 + [{"track": "safety", "split": "train", "safety_bin": "both safe"}] * 300
            + [{"track": "safety", "split": "train", "safety_bin": "both unsafe"}] * 50 + [{"track": "helpfulness", "split": "test"}] * 20)
    helpful = reward_mix(rows, "helpfulness", 0.5, seed=0)
    assert (sum(r["track"] == "helpfulness" for r in helpful), sum(r["track"] == "safety" for r in helpful)) == (100, 100)  # equal parts
    safety = reward_mix(rows, "safety", 0.1, seed=0)
    assert (sum(r["track"] == "safety" for r in safety), sum(r["track"] == "helpfulness" for r in safety)) == (350, 39)  # 90/10
    assert sum(r.get("safety_bin") == "both unsafe" for r in safety) == 50  # kept, as the paper keeps them
    assert all(r["split"] == "train" for r in helpful + safety)


def test_reward_mixes_draw_the_rest_from_other_track_and_open_rows():
    rows = [{"track": "helpfulness", "split": "train"}] * 100 + [{"track": "safety", "split": "train", "safety_bin": "both safe"}] * 300
    open_rows = [{"track": "helpfulness", "split": "train", "source": "open"}] * 1000
    helpful = reward_mix(rows, "helpfulness", 0.75, seed=0, open_rows=open_rows)
    own = sum(r["track"] == "helpfulness" and "source" not in r for r in helpful)
    assert (len(helpful), own) == (400, 100)  # the rest: 3 x 100 rows, drawn from 300 safety + 1000 open rows
    everything = reward_mix(rows, "helpfulness", 0.95, seed=0, open_rows=open_rows)  # wants 1900 of the 1300 there are: all of them
    assert (len(everything), sum(r.get("source") == "open" for r in everything)) == (1400, 1000)
    safety = reward_mix(rows, "safety", 0.1, seed=0, open_rows=open_rows)  # 90/10: 300 safety rows and round(300 / 9) from helpful + open
    assert (len(safety), sum(r["track"] == "safety" for r in safety)) == (333, 300)


def test_open_preferences_prefer_the_right_twin_by_execution():
    from slm_bench.data.synth import planted_error_twins
    from slm_bench.evals.sandbox import Sandbox
    from slm_bench.lm.tokenizer import train_tokenizer
    from slm_bench.methods.llama2 import open_preferences
    from slm_bench.methods.tinygsm import program_body

    twins = planted_error_twins(8, seed=11)
    tokenizer = train_tokenizer([p.program for twin in twins for p in twin], vocab_size=300)
    with Sandbox(workers=1) as box:
        rows = open_preferences(twins, tokenizer, box, ProgrammaticAnnotator(seed=0), "large")
    assert [(r["chosen"], r["rejected"]) for r in rows] == [(program_body(a.to_json()), program_body(b.to_json())) for a, b in twins]
    assert {(r["rating"], r["margin"]) for r in rows} == {("significantly better", 3.0)}
    assert [r["chosen_facts"]["correct"] for r in rows] == [True] * 8 and [r["rejected_facts"]["correct"] for r in rows] == [False] * 8


def test_preference_rows_are_checked_at_the_boundary():
    row = {"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3], "rating": "better", "track": "safety"}
    with pytest.raises(BadInput, match="row 1: missing prompt_ids"):
        validate_preferences([{k: v for k, v in row.items() if k != "prompt_ids"}])
    with pytest.raises(BadInput, match="row 2: chosen and rejected are the same response"):
        validate_preferences([row, {**row, "rejected_ids": [2]}])
