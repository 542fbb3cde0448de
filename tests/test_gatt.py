"""Ghost Attention: the instruction checks, GAtt's masking, the sandbox verdicts on the teacher's dialogues, the attention measure against uniform
attention, and the control: the same dialogues and cuts without any instruction, and the per-turn paired effect on planted verdicts."""
import pytest
import torch

from slm_bench.core.errors import BadInput
from slm_bench.lm.models import create_model, get_preset
from slm_bench.lm.packing import IGNORE
from slm_bench.lm.tokenizer import train_tokenizer
from slm_bench.methods.gatt import (COMBINATIONS, Dialogue, DialogueQuestion, adheres, chat_examples, control_examples, cut_examples, dialogue_questions,
                                    dialogue_tokens, gatt_cuts, gatt_examples, holds_instruction, instruction_text, judge_dialogues, make_dialogues, obeys,
                                    paired_at_turn, sample_responses, system_attention, teacher_body, teacher_responses, without_instruction)


@pytest.fixture(scope="module")
def tokenizer():
    texts = [f"# {q.question}\n" + teacher_body(q, keys) + f"# {instruction_text(keys)}\n# {instruction_text(keys, terse=True)}\n"
             for q in dialogue_questions(60, seed=9) for keys in COMBINATIONS]
    return train_tokenizer(texts, vocab_size=300)


def test_each_instruction_is_checked_on_the_program_and_its_value():
    q = DialogueQuestion("41 * 6", "41 * 6", 246)
    assert teacher_body(q, ("answer_only", "round_tens")) == "return 250\n"
    assert teacher_body(q, ("name_total",)) == "total = 41 * 6\nreturn total\n"
    assert [obeys("answer_only", b, 246) for b in ("return 246\n", "return 41 * 6\n", "x = 246\nreturn x\n")] == [True, False, False]
    assert [obeys("name_total", b, 246) for b in ("total = 41 * 6\nreturn total\n", "return total\n", "result = 1\nreturn result\n")] == [True, False, False]
    assert [obeys("round_tens", "", v) for v in (250, 246, None, "250")] == [True, False, False, False]
    assert adheres(("name_total", "round_tens"), "total = round(41 * 6, -1)\nreturn total\n", 250)
    assert not adheres(("name_total", "round_tens"), "total = 41 * 6\nreturn total\n", 246)


def test_gatt_drops_the_instruction_after_turn_one_and_trains_only_the_last_response(tokenizer):
    d = teacher_responses(tokenizer, Dialogue(("round_tens",), False, dialogue_questions(4, seed=1), [], instructed=(0, 1, 2, 3)))
    sampled_with = dialogue_tokens(tokenizer, d, 4, instruction_every_turn=True)
    assert tokenizer.decode(sampled_with["input_ids"]).count(instruction_text(("round_tens",))) == 4
    examples = gatt_examples(tokenizer, [d])
    assert len(examples) == 3  # cut after turns 2, 3 and 4
    for turn, example in zip((1, 2, 3), examples):
        assert tokenizer.decode(example["input_ids"]).count(instruction_text(("round_tens",))) == 1
        trained = [i for i, label in zip(example["input_ids"], example["labels"]) if label != IGNORE]
        assert trained == d.responses[turn]  # the loss only on the last response: earlier assistant turns are zeroed too
        assert example["input_ids"][-len(d.responses[turn]):] == d.responses[turn]
    only_adherent = gatt_examples(tokenizer, [d], adhered=[[True, False, True, False]])
    assert [e["input_ids"][-len(d.responses[2]):] for e in only_adherent] == [d.responses[2]]


def test_chat_dialogues_obey_only_where_the_instruction_is_written(tokenizer):
    qs = dialogue_questions(3, seed=2)
    d = teacher_responses(tokenizer, Dialogue(("answer_only",), True, qs, [], instructed=(1,)))
    assert d.bodies == [f"return {qs[0].expression}\n", f"return {qs[1].answer}\n", f"return {qs[2].expression}\n"]
    example = chat_examples(tokenizer, [Dialogue(("answer_only",), True, qs, [], instructed=(1,))])[0]
    assert [i for i, label in zip(example["input_ids"], example["labels"]) if label != IGNORE] == sum(d.responses, [])


def test_the_sandbox_verdicts_on_teacher_dialogues(tokenizer):
    from slm_bench.evals.sandbox import Sandbox

    plan = make_dialogues(10, 3, seed=5)
    obeying = [teacher_responses(tokenizer, d) for d in plan]
    default = [teacher_responses(tokenizer, d, follow=False) for d in plan]
    with Sandbox() as box:
        judged_obeying, judged_default = judge_dialogues(obeying, box), judge_dialogues(default, box)
    # the teacher obeys on turn 1 (its instructed turn) and writes the default elsewhere; default answers are right
    assert [a[0] for a in judged_obeying["adheres"]] == [True] * 10
    assert all(r[0] for r in judged_obeying["right"])
    assert [a[0] for a in judged_default["adheres"]] == [False] * 10
    assert [r[0] for r in judged_default["right"]] == ["round_tens" not in d.keys for d in plan]


def test_attention_on_the_system_message_equals_its_share_under_uniform_attention(tokenizer):
    "With every query projection zeroed, attention is uniform over the causal prefix: the mass on the instruction is its length over the position + 1."
    model = create_model(get_preset("llama-0.5m", vocab_size=len(tokenizer), max_position_embeddings=256), seed=0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.zero_()
    d = teacher_responses(tokenizer, Dialogue(("name_total",), False, dialogue_questions(2, seed=3), []))
    ex = dialogue_tokens(tokenizer, d, 2)
    (s, e), start = ex["instruction_span"], ex["response_starts"][1]
    expected = sum((e - s) / (q + 1) for q in range(start, start + len(d.responses[1]))) / len(d.responses[1])
    assert system_attention(model, tokenizer, d, 2) == pytest.approx([expected] * 4, abs=1e-5)
    assert model.config._attn_implementation != "eager"  # restored


def test_a_dialogue_ends_where_the_context_is_full(tokenizer):
    from slm_bench.infer.sampling import HFSampler

    model = create_model(get_preset("llama-0.5m", vocab_size=len(tokenizer), max_position_embeddings=120), seed=0)
    plan = make_dialogues(2, 10, seed=6)
    answered = sample_responses(HFSampler(model, tokenizer), plan, max_new_tokens=8)
    for d, planned in zip(answered, plan):
        n = len(d.questions)
        assert len(d.responses) == n < 10
        last_prompt = Dialogue(d.keys, d.terse, d.questions, d.responses[:-1])
        assert len(dialogue_tokens(tokenizer, last_prompt, n)["input_ids"]) + 8 <= 120  # the last turn answered fitted
        next_prompt = Dialogue(d.keys, d.terse, planned.questions[:n + 1], d.responses)
        assert len(dialogue_tokens(tokenizer, next_prompt, n + 1)["input_ids"]) + 8 > 120  # the next would not have
    with pytest.raises(BadInput, match="first prompt has"):
        sample_responses(HFSampler(model, tokenizer), plan, max_new_tokens=119)


# --- the control (issue 53): the same dialogues, the same cuts, no instruction ---

def _questions(tokenizer, example) -> list[str]:
    "The user questions of an example, in order, read back from its tokens."
    import re

    return re.findall(r"# (\d+ [-+*] \d+)\n", tokenizer.decode(example["input_ids"], skip_special_tokens=True))


@pytest.fixture(scope="module")
def arms(tokenizer):
    "GAtt's and the control's examples from the same plan: the teacher stands in for the model, obeying where the instruction is written."
    plan = make_dialogues(8, 6, seed=11, min_turns=2)
    sampled = [teacher_responses(tokenizer, Dialogue(d.keys, d.terse, d.questions, [], instructed=tuple(range(len(d.questions))))) for d in plan]
    plain = [teacher_responses(tokenizer, d) for d in without_instruction(plan)]
    adhered = [[(i + t) % 3 != 0 for t in range(len(d.questions))] for i, d in enumerate(plan)]  # a planted RS filter
    cuts = gatt_cuts(sampled, adhered, also=plain)
    return plan, sampled, plain, cuts, cut_examples(tokenizer, sampled, cuts), control_examples(tokenizer, plain, cuts)


def test_the_controls_examples_hold_no_instruction_at_all(tokenizer, arms):
    "Every token of a control example is a question line or a response: BOS, then '# question' and the response, turn by turn."
    plan, _, plain, cuts, gatt, control = arms
    assert len(control) == len(cuts) > 10
    for (i, last), example in zip(cuts, control):
        expected = [tokenizer.bos_token_id]
        for t in range(last + 1):
            expected += tokenizer(f"# {plan[i].questions[t].question}\n", add_special_tokens=False)["input_ids"] + plain[i].responses[t]
        assert example["input_ids"] == expected, (i, last)
        assert [x for x, label in zip(example["input_ids"], example["labels"]) if label != IGNORE] == plain[i].responses[last]
    assert [holds_instruction(tokenizer, e) for e in control] == [False] * len(control)
    assert [holds_instruction(tokenizer, e) for e in gatt] == [True] * len(gatt)  # the check sees an instruction where there is one
    assert all(tokenizer.decode(e["input_ids"]).count(plan[i].instruction) == 1 for (i, _), e in zip(cuts, gatt))  # GAtt: turn 1 only
    with pytest.raises(BadInput, match="carry an instruction"):
        control_examples(tokenizer, plan, cuts)


def test_gatt_and_the_control_cover_the_same_dialogues_and_turns(tokenizer, arms):
    plan, sampled, plain, cuts, gatt, control = arms
    assert cuts == [(i, t) for i, d in enumerate(plan) for t in range(1, len(d.questions)) if (i + t) % 3 != 0]
    assert [_questions(tokenizer, e) for e in gatt] == [_questions(tokenizer, e) for e in control] \
        == [[q.question for q in plan[i].questions[:last + 1]] for i, last in cuts]
    # the loss on the same turn: the last response of each, the instruction obeyed in GAtt's, the default style in the control's
    for (i, last), g, c in zip(cuts, gatt, control):
        assert [x for x, label in zip(g["input_ids"], g["labels"]) if label != IGNORE] == sampled[i].responses[last]
        assert [x for x, label in zip(c["input_ids"], c["labels"]) if label != IGNORE] == plain[i].responses[last]
        assert sampled[i].bodies[last] == teacher_body(plan[i].questions[last], plan[i].keys) != plain[i].bodies[last] == teacher_body(plan[i].questions[last])
    # a control dialogue that ended earlier (its context full) drops that cut from both arms
    short = [Dialogue((), d.terse, d.questions[:2], d.responses[:2], d.bodies[:2]) if i == 0 else d for i, d in enumerate(plain)]
    assert [c for c in gatt_cuts(sampled, also=short) if c[0] == 0] == [(0, 1)]


def test_the_starting_models_instructions_are_written_on_every_later_turn(tokenizer):
    "Neither kept nor dropped: once an instruction is written, every later user turn writes it again and its response obeys it."
    plan = make_dialogues(40, 6, seed=12, min_turns=1, instructed="from")
    assert {d.instructed[0] for d in plan} > {0}  # it starts at various turns
    for d, example in zip(plan, chat_examples(tokenizer, plan)):
        lines = [line for line in tokenizer.decode(example["input_ids"], skip_special_tokens=True).split("\n") if line.strip().startswith("#")]
        instructed = [i for i, line in enumerate(lines) if line.strip() == f"# {d.instruction}"]
        assert len(instructed) == len(d.questions) - d.instructed[0]
        assert all(lines[i + 1].strip().startswith("# ") and lines[i + 1].strip() != f"# {d.instruction}" for i in instructed)  # each before its question
        assert instructed == list(range(d.instructed[0], len(lines), 2))  # from the first instructed turn, every turn to the end


def test_the_per_turn_paired_effect_on_planted_verdicts():
    "GAtt − control at one turn over the same dialogues: a better arm reproduces, an equal arm is inconclusive, a worse one contradicts."
    from slm_bench.core.claims import claim
    from slm_bench.evals.findings import Finding

    holds, drops = [True] * 5, [True] + [False] * 4  # obeys on every turn / only where the instruction is written
    experiment = [holds] * 20 + [holds[:2]] * 5  # five dialogues ended after turn 2 (the context full)
    control = [drops] * 20 + [drops[:3]] * 5
    assert paired_at_turn(experiment, control, 4) == ([True] * 20, [False] * 20)
    assert paired_at_turn(experiment, control, 2) == ([True] * 25, [False] * 25)

    def verdict(exp, ctl, turn, claim_id="llama2.gatt_holds_20_turns"):
        f = Finding.paired("planted", claim(claim_id), "with GAtt", "without GAtt", paired_at_turn(exp, ctl, turn))
        return f.verdict, round(f.effect["difference"], 4), f.effect["n"]

    assert verdict(experiment, control, 4) == ("reproduced", 1.0, 20)
    assert verdict(experiment, experiment, 4) == ("inconclusive", 0.0, 20)
    assert verdict(control, experiment, 4) == ("contradicted", -1.0, 20)
    assert verdict(experiment, control, 1) == ("inconclusive", 0.0, 25)  # turn 1: the instruction is written there, both obey
    half = [holds] * 10 + [drops] * 10
    assert verdict(half, control[:20], 4) == ("reproduced", 0.5, 20)
    # turn 2, non-inferiority within 10 points (Table 30: both 100%): equal arms reproduce, a much worse GAtt contradicts
    assert verdict(experiment, experiment, 2, "llama2.gatt_turn2") == ("reproduced", 0.0, 25)
    assert verdict(control, experiment, 2, "llama2.gatt_turn2") == ("contradicted", -1.0, 25)
