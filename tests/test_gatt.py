"""Ghost Attention: the instruction checks, GAtt's masking, the sandbox verdicts on the teacher's dialogues, and the attention measure against uniform attention."""
import pytest
import torch

from slm_bench.core.errors import BadInput
from slm_bench.lm.models import create_model, get_preset
from slm_bench.lm.packing import IGNORE
from slm_bench.lm.tokenizer import train_tokenizer
from slm_bench.methods.gatt import (COMBINATIONS, Dialogue, DialogueQuestion, adheres, chat_examples, dialogue_questions, dialogue_tokens,
                                    gatt_examples, instruction_text, judge_dialogues, make_dialogues, obeys, sample_responses, system_attention,
                                    teacher_body, teacher_responses)


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
