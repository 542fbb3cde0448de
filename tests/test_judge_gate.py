"""Phi-4's judge-guided DPO (issue 54): the verifier judge cannot read the true answer, the audit's gate passes a judge that
agrees with execution and blocks one that does not, and length bias is measured on the judge (nonzero for a judge that favours length)."""
import random
from dataclasses import dataclass, replace

import pytest

from slm_bench.evals.judge import JudgeItem, compare_by_grade, length_bias, pad_answer, position_bias, rule_aspects
from slm_bench.lm.models import create_model, get_preset
from slm_bench.lm.tokenizer import train_tokenizer
from slm_bench.methods.judge_dpo import VerifierJudge, judge_audit, judge_gate, program_parts
from slm_bench.train.verifier import VerifierModel

HEADER = 'def simple_math_problem() -> int:\n    """\n    {q}\n    """\n'
QUESTIONS = [f"Ann has {a} pens and buys {b} more. How many pens does she have?" for a in range(2, 9) for b in range(2, 5)]


def program(question, a, b, right=True):
    return HEADER.format(q=question) + f"    pens = {a}\n    bought = {b}\n    total = pens {'+' if right else '-'} bought\n    return total\n"


@pytest.fixture(scope="module")
def tokenizer():
    texts = [program(q, a, b, r) for q, (a, b) in zip(QUESTIONS, [(a, b) for a in range(2, 9) for b in range(2, 5)]) for r in (True, False)]
    return train_tokenizer(texts * 3, vocab_size=320)


@pytest.fixture(scope="module")
def verifier(tokenizer):
    "A tiny random verifier of the real class: the mechanics, not the quality."
    base = create_model(get_preset("llama-0.5m", vocab_size=len(tokenizer), max_position_embeddings=256), seed=0,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return VerifierModel.from_generator(base).eval()


def items():
    pairs = [(a, b) for a in range(2, 9) for b in range(2, 5)]
    return [JudgeItem(q, program(q, a, b, right=i % 2 == 0), gold=a + b, givens=(a, b)) for i, (q, (a, b)) in enumerate(zip(QUESTIONS, pairs))]


def test_the_verifier_judge_reads_the_text_only(tokenizer, verifier):
    "Items that differ only in the true answer (and the givens) get the same scores, from a judge that has seen neither set before."
    plain = items()
    told = [replace(i, gold=i.gold + 1000, givens=(99,)) for i in plain]
    first, second = VerifierJudge(verifier, tokenizer), VerifierJudge(verifier, tokenizer)  # separate caches: both really score
    assert first.aspects(plain) == second.aspects(told)
    p = first.p_correct(plain)
    assert len(set(round(x, 6) for x in p)) > 1, "the random verifier should still tell texts apart"
    assert first.aspects(plain)[0] == rule_aspects(plain[0].answer, 1 + 9 * p[0])  # accuracy 1 + 9p, style and detail by the rules
    # the text itself does reach it: a different program gets a different score
    changed = [replace(i, answer=i.answer.replace("return total", "return total * 2")) for i in plain]
    assert VerifierJudge(verifier, tokenizer).p_correct(changed) != p


def test_program_parts_split_where_the_docstring_closes():
    text = program("Ann has 2 pens.", 2, 3)
    head, body = program_parts(text)
    assert head == HEADER.format(q="Ann has 2 pens.") and body.startswith("    pens = 2") and head + body == text
    assert program_parts("return 3") == ("return 3", "")
    padded = pad_answer(text)  # the padding lands in the body: the response, not the question
    assert program_parts(padded)[0] == head and program_parts(padded)[1].startswith("    # ")


def test_position_is_fixed_by_construction_and_length_bias_is_measured(tokenizer, verifier):
    judge = VerifierJudge(verifier, tokenizer)
    plain = items()
    assert position_bias(judge, plain[0::2], plain[1::2])["consistent"] == 1.0  # pointwise: the order cannot matter
    bias = length_bias(judge, plain)
    assert bias["grade_gain"] != 0.0  # the random verifier reads the padding comment

    @dataclass
    class Wordy:  # a planted judge that favours length: one point per line
        kind: str = "planted"

        def grade(self, items):
            return [float(len(i.answer.splitlines())) for i in items]

        def compare(self, a, b):
            return compare_by_grade(self, a, b)

    wordy = length_bias(Wordy(), plain)
    assert wordy["grade_gain"] == 1.0 and wordy["longer_wins"] == 1.0 and wordy["shorter_wins"] == 0.0


def oracle_and_scores(judge_right, n=200, seed=0):
    rng = random.Random(seed)
    oracle = [rng.random() < 0.5 for _ in range(n)]
    return [{"accuracy": 9.0 if j else 2.0} for j in judge_right(oracle, rng)], oracle


def test_the_gate_passes_a_good_judge_and_blocks_constant_and_shuffled_ones():
    good = judge_audit(*oracle_and_scores(lambda o, rng: [x if rng.random() < 0.9 else not x for x in o]))
    assert 0.85 <= good["agreement"]["accuracy"] <= 0.95
    gate = judge_gate(good, 0.7)
    assert gate["passed"] and gate["why"] == "" and gate["agreement"] == good["agreement"]["ci_low"]
    constant = judge_audit(*oracle_and_scores(lambda o, rng: [True] * len(o)))
    shuffled = judge_audit(*oracle_and_scores(lambda o, rng: rng.sample(o, len(o))))
    for audit in (constant, shuffled):
        gate = judge_gate(audit, 0.7)
        assert not gate["passed"] and gate["why"].startswith("the judge failed its audit: agreement (ci_low)") and "< threshold 70%" in gate["why"]
    # the bound matters: a point estimate at the threshold passes on "point", not on the interval's lower end
    edge = judge_audit([{"accuracy": 9.0}] * 35 + [{"accuracy": 2.0}] * 15 + [{"accuracy": 2.0}] * 35 + [{"accuracy": 9.0}] * 15, [True] * 50 + [False] * 50)
    assert judge_gate(edge, 0.7, bound="point")["passed"] and not judge_gate(edge, 0.7)["passed"]


def test_the_gate_blocks_a_judge_no_better_than_a_constant_one():
    "Most answers right: accepting everything agrees often, above the threshold, and still fails the gate."
    accepts_all = judge_audit([{"accuracy": 9.0}] * 200, [True] * 180 + [False] * 20)
    assert accepts_all["constant_agreement"] == 0.9 and accepts_all["agreement"]["ci_low"] > 0.7
    assert judge_gate(accepts_all, 0.7, bound="point")["why"] == "the judge failed its audit: agreement (point) 90.0% does not beat a constant judge's 90.0%"
    assert not judge_gate(accepts_all, 0.7)["passed"]
