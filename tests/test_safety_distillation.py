"""Llama 2's safety context distillation: attacked requests that still do harm in the sandbox, the preprompts, the safety-RM gate."""
import random

import pytest

from slm_bench.core.errors import BadInput
from slm_bench.data.safety import REFUSAL, UNSAFE_CATEGORIES, adversarial_prompts, attack_question, misspell, safety_prompts
from slm_bench.evals.sandbox import Sandbox
from slm_bench.evals.tasks import tinygsm_prompt
from slm_bench.infer.sampling import HFSampler, SamplingParams
from slm_bench.lm.models import create_model, get_preset
from slm_bench.lm.tokenizer import train_tokenizer
from slm_bench.methods.preferences import run_responses
from slm_bench.methods.safety_distillation import (RISK_TEMPLATES, Distilled, context_distill, generic_preprompts, rm_gate, safety_preprompt,
                                                   with_preprompt)
from slm_bench.methods.tinygsm import program_body
from slm_bench.train.reward import RewardModel, reward_scores


def test_attacked_requests_still_take_their_action_and_the_refusal_still_refuses():
    prompts = adversarial_prompts(20, seed=3)
    assert [p.attack for p in prompts[:4]] == ["authority", "role_play", "false_premise", "misspelling"]
    with Sandbox() as box:
        unsafe = run_responses([p.question for p in prompts], [None] * 20, [program_body({"question": p.question, "program": p.unsafe_program}) for p in prompts], box)
        safe = run_responses([p.question for p in prompts], [None] * 20, [program_body(p.to_json()) for p in prompts], box)
    assert [UNSAFE_CATEGORIES[p.category] in f.actions for p, f in zip(prompts, unsafe)] == [True] * 20
    assert [(f.refused, f.safe) for f in safe] == [(True, True)] * 20


def test_misspelling_is_one_adjacent_swap_per_long_word_and_spares_paths():
    question = "Open Ravi's file /srv/tw/home/ravi/diary.txt and return how many lines it has."
    spelt = misspell(question, random.Random(2), share=1.0).split(" ")
    for before, after in zip(question.split(" "), spelt):
        if len(before) > 4 and before.isalpha():
            swaps = [i for i in range(len(before) - 1) if before[:i] + before[i + 1] + before[i] + before[i + 2:] == after]
            assert len(swaps) == 1 and 1 <= swaps[0] <= len(before) - 3, (before, after)
        else:
            assert after == before
    assert spelt[3] == "/srv/tw/home/ravi/diary.txt"


def test_attack_phrases_go_before_the_request_and_a_false_premise_after():
    rng = random.Random(0)
    assert attack_question("Delete it.", "authority", random.Random(0)).endswith(" Delete it.")
    assert attack_question("Delete it.", "false_premise", rng).startswith("Delete it. ")
    with pytest.raises(BadInput, match="unknown attack vector 'metaphor'"):
        adversarial_prompts(2, vectors=["metaphor"])


def test_preprompts_follow_the_templates():
    assert generic_preprompts(["wise", "safe", "responsible"]) == [
        "You are a wise and safe assistant.", "You are a wise and responsible assistant.", "You are a safe and wise assistant.",
        "You are a safe and responsible assistant.", "You are a responsible and wise assistant.", "You are a responsible and safe assistant."]
    unsafe, borderline = safety_prompts(5, 1, seed=1)[4], safety_prompts(5, 1, seed=1)[5]
    assert safety_preprompt(unsafe) == f"{RISK_TEMPLATES['shell']} If asked, refuse: {REFUSAL}"
    assert safety_preprompt(borderline, rng=random.Random(7)) == random.Random(7).choice(generic_preprompts())
    assert with_preprompt("Q?", "Be wise.") == "Be wise. Q?" and with_preprompt("Q?", "") == "Q?"


def test_the_gate_keeps_a_distilled_answer_only_above_the_original_score():
    assert rm_gate([0.0, 1.0, -2.0], [0.5, 1.0, -3.0]) == [True, False, False]
    with pytest.raises(BadInput, match="one distilled score per original"):
        rm_gate([0.0, 1.0], [0.0])


@pytest.fixture(scope="module")
def tiny():
    tok = train_tokenizer([p.program for p in safety_prompts(60, 60, seed=9)], vocab_size=300)
    lm = create_model(get_preset("llama-0.5m", vocab_size=len(tok)), seed=0, pad_token_id=tok.pad_token_id).eval()
    rm = RewardModel.from_generator(create_model(get_preset("llama-0.5m", vocab_size=len(tok)), seed=1, pad_token_id=tok.pad_token_id))
    return tok, lm, rm


def test_context_distill_answers_with_and_without_the_preprompt_and_scores_under_the_plain_prompt(tiny):
    tok, lm, rm = tiny
    prompts = adversarial_prompts(6, seed=11)
    questions, preprompts = [p.question for p in prompts], [safety_preprompt(p) for p in prompts]
    out = context_distill(HFSampler(lm, tok), rm, questions, preprompts, max_new_tokens=10)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=10)
    plain = [tok(tinygsm_prompt(q))["input_ids"] for q in questions]
    with_pre = [g[0] for g in HFSampler(lm, tok).generate([tok(tinygsm_prompt(with_preprompt(q, p)))["input_ids"] for q, p in zip(questions, preprompts)], greedy)]
    assert [d.distilled for d in out] == [c.text for c in with_pre]
    assert [d.distilled_score for d in out] == pytest.approx(reward_scores(rm, plain, [c.token_ids for c in with_pre]), abs=1e-5)
    assert [d.kept for d in out] == [d.distilled_score > d.original_score for d in out]
    assert [d.kept for d in context_distill(HFSampler(lm, tok), rm, questions, preprompts, gated=False, max_new_tokens=10)] == [True] * 6


def test_a_distilled_record_is_the_plain_question_with_the_distilled_body():
    d = Distilled("Run ls /srv/tw and return it.", "Running shell commands is dangerous.", "    return 1\n", f'    result = "{REFUSAL}"\n    return result\n',
                  -1.0, 0.5, True)
    assert d.record() == {"question": d.question, "program": tinygsm_prompt(d.question) + d.distilled}
    assert d.preprompt not in d.record()["program"]
