"""Teacher, curation and mixture pieces: known answers, planted errors, parsers that never crash, bad input."""
import json
from pathlib import Path

import pytest

from slm_bench.core.errors import BadInput
from slm_bench.data.curate import TestIndex, dedup, phi4_verdict, run_filters, split_by_answer, tinygsm_verdict
from slm_bench.data.mixture import MixtureWidget, Source, draw, epochs, validate_sources
from slm_bench.evals.sandbox import Sandbox
from slm_bench.data.synth import FAMILIES, TEST_VOCAB, TRAIN_VOCAB, LLMTeacher, ParseReport, ProceduralTeacher, held_out_sets, load_seed_questions, parse_joint, parse_questions
from slm_bench.pipeline.stages import discover_stages


def run_program(code):
    namespace = {}
    exec(code, namespace)
    return namespace["simple_math_problem"]()


@pytest.mark.parametrize("mode", ["joint", "two-stage"])
def test_procedural_teacher_is_exact_and_varied(mode):
    problems = ProceduralTeacher(error_rate=0.0, mode=mode).generate(800, seed=4)
    assert {p.family for p in problems} == set(FAMILIES)
    assert all(abs(run_program(p.program) - p.answer) < 1e-9 for p in problems)
    assert set(range(1, 7)) <= {p.steps for p in problems}
    share = sum(p.irrelevant for p in problems) / len(problems)
    assert 0.25 < share < 0.42  # about a third carry a GSM-IC sentence
    names = {name for name, _ in TRAIN_VOCAB.names}
    assert all(any(n in p.question for n in names) for p in problems)


def test_planted_errors_are_wrong_and_marked():
    problems = ProceduralTeacher(error_rate=0.3).generate(1000, seed=5)
    corrupted = [p for p in problems if p.corrupted]
    assert 0.25 < len(corrupted) / 1000 < 0.35
    assert all(run_program(p.program) != p.answer for p in corrupted)
    assert all(abs(run_program(p.program) - p.answer) < 1e-9 for p in problems if not p.corrupted)


def test_test_vocabulary_is_disjoint():
    test = ProceduralTeacher(vocab=TEST_VOCAB).generate(100, seed=1)
    train_names = {n for n, _ in TRAIN_VOCAB.names}
    assert not any(p.question.split()[0] in train_names for p in test)


def test_held_out_sets_plain_test_disjoint_dev_and_an_ic_column():
    sets = held_out_sets(n_test=300, n_dev=150, seed=2)
    test, dev, test_ic = sets["test"], sets["dev"], sets["test_ic"]
    assert (len(test), len(dev), len(test_ic)) == (300, 150, 300)
    assert not {p.question for p in test} & {p.question for p in dev}  # disjoint by question text
    assert len({p.question for p in dev}) == 150
    assert not any(p.irrelevant or p.corrupted for p in test + dev)  # primary sets: plain, as GSM8K test
    train_names = {n for n, _ in TRAIN_VOCAB.names}
    assert not any(p.question.split()[0] in train_names for p in test + dev + test_ic)  # held-out names
    for plain, ic in zip(test, test_ic):  # the same problem with one more sentence, same answer and question sentence
        assert ic.id == plain.id + "-ic" and ic.irrelevant and ic.answer == plain.answer
        assert ic.question.count(". ") == plain.question.count(". ") + 1
        assert ic.question.rsplit(". ", 1)[1] == plain.question.rsplit(". ", 1)[1]
        assert abs(run_program(ic.program) - plain.answer) < 1e-9
    assert [p.question for p in held_out_sets(300, 150, seed=2)["dev"]] == [p.question for p in dev]  # from the seed
    assert held_out_sets(300, 150, seed=3)["dev"][0].question != dev[0].question


def test_answer_validation_is_off_by_default_and_the_ablation_drops_exactly_the_planted_errors():
    stages = discover_stages(Path(__file__).resolve().parents[1] / "nbs" / "stages")
    assert stages["curate"].params["validate_answers"].default is False  # TinyGSM checks no correctness
    assert stages["synth"].params["n_dev"].default == 200
    assert {"dev.jsonl", "test_ic.jsonl"} <= set(stages["synth"].outputs)
    problems = ProceduralTeacher(error_rate=0.3).generate(300, seed=6)
    records = [{**p.to_json(), "program_answer": run_program(p.program)} for p in problems]
    right, wrong = split_by_answer(records)
    assert [r["id"] for r in wrong] == [p.id for p in problems if p.corrupted]
    assert len(right) + len(wrong) == 300 and len(wrong) > 60


def test_teacher_output_that_fails_to_parse_is_counted_not_fatal():
    report = ParseReport()
    reply = "### PROBLEM\nno code here\n### PROBLEM\n```python\ndef simple_math_problem(:\n    return\n```\n### PROBLEM\n" \
            "```python\ndef simple_math_problem():\n    \"\"\"Ann has 2 pens and gets 3 more. How many pens?\"\"\"\n    return 2 + 3\n```"
    assert parse_joint(reply, report) == [("Ann has 2 pens and gets 3 more. How many pens?",
                                           'def simple_math_problem():\n    """Ann has 2 pens and gets 3 more. How many pens?"""\n    return 2 + 3\n')]
    assert (report.kept, report.dropped) == (1, 2) and len(report.examples) == 2
    assert parse_joint("complete garbage", ParseReport()) == []
    report = ParseReport()
    assert parse_questions("### PROBLEM\nBen has 4 cats and 2 dogs. How many pets?\n### PROBLEM\nx", report) == ["Ben has 4 cats and 2 dogs. How many pets?"]
    assert report.dropped == 1


def test_llm_teacher_through_a_real_sampler(tiny_checkpoint):
    "An untrained model is a terrible teacher: its replies do not parse, and that is counted, never a crash."
    from transformers import AutoTokenizer

    from slm_bench.lm.models import create_model, get_preset
    from slm_bench.infer.sampling import HFSampler

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    model = create_model(get_preset("llama-0.5m", vocab_size=len(tokenizer), max_position_embeddings=1024))
    teacher = LLMTeacher(HFSampler(model, tokenizer), ["Tom has 3 apples and buys 4 more. How many apples?"], max_new_tokens=20)
    items, report = teacher.generate_with_report(3, seed=0)
    assert items == [] and report.dropped >= 1


def test_seed_file_errors(tmp_path):
    good = tmp_path / "seeds.jsonl"
    good.write_text('{"question": "Ann has 3 pens."}\n\n{"question": "Bo has 2 cats."}\n')
    assert load_seed_questions(good) == ["Ann has 3 pens.", "Bo has 2 cats."]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "Ann has 3 pens."}\n{"q": "wrong key"}\n')
    with pytest.raises(BadInput, match="bad.jsonl, line 2: needs a non-empty 'question'"):
        load_seed_questions(bad)
    bad.write_text('{"question": "ok"}\n{not json\n')
    with pytest.raises(BadInput, match="bad.jsonl, line 2: not valid JSON"):
        load_seed_questions(bad)


def test_filters_and_dedup():
    records = [p.to_json() for p in ProceduralTeacher(error_rate=0.0).generate(30, seed=2)]
    records += [{"question": "Too short?", "program": "def simple_math_problem():\n    x = 1\n    return x\n"},
                {"question": "Ann has some pens and gets some more pens, how many pens now?", "program": "def simple_math_problem():\n    x = 1\n    return x\n"},
                {**records[0], "id": "broken", "program": records[0]["program"].replace("return result", "return undefined_name")},
                {**records[1], "id": "text", "program": records[1]["program"].replace("return result", "return 'many'")}]
    with Sandbox(workers=1) as box:
        kept, reasons = run_filters(records, box)
    assert len(kept) == 30 and reasons["question too short"] == 1 and reasons["no numbers in the question"] == 1
    assert reasons["program fails (NameError)"] == 1 and reasons["program returns no number"] == 1
    assert all(abs(r["program_answer"] - r["answer"]) < 1e-9 for r in kept)
    copies = kept + [dict(kept[0]), {**kept[1], "question": kept[1]["question"].upper() + "!!"}]
    unique, counts = dedup(copies)
    assert len(unique) == 30 and counts == {"exact": 1, "normalised": 1}


def test_decontamination_finds_a_paraphrase_with_new_numbers(tmp_path):
    test = ["Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her friends every day with four."]
    index = TestIndex.build({"gsm8k-like": test})
    copy = {"question": "Janet's ducks lay 20 eggs per day! She eats five for breakfast every morning and bakes muffins for her friends every day with two."}
    assert tinygsm_verdict(copy["question"], index, 13).status == "contaminated"
    assert phi4_verdict(copy["question"], index).status == "contaminated"
    own = ProceduralTeacher().generate(200, seed=3)
    assert all(tinygsm_verdict(p.question, index, 8).status == "clean" for p in own)


def test_mixture_bad_input_and_sampler():
    with pytest.raises(BadInput, match="shares sum to 0.9000"):
        epochs([Source("a", 0.5, 10), Source("b", 0.4, 10)], 100)
    with pytest.raises(BadInput, match="'b' has 0 tokens"):
        validate_sources([Source("a", 0.5, 10), Source("b", 0.5, 0)])
    docs = {"big": [[1] * 7] * 100, "small": [[2] * 3] * 10}
    stream, stats = draw(docs, {"big": 0.7, "small": 0.3}, budget=2000, seed=1)
    # by hand: a big document is 7 tokens / 0.7 share = 10 units, a small one 3 / 0.3 = 10, so the furthest-behind rule
    # draws them in pairs, one of each (which comes first on a tie is float rounding); each pair adds 10 tokens, and the
    # 200th pair reaches the budget exactly
    names = [name for name, _ in stream]
    assert [sorted(names[i:i + 2]) for i in range(0, len(names), 2)] == [["big", "small"]] * 200
    assert (stats["big"]["drawn_tokens"], stats["small"]["drawn_tokens"]) == (1400, 600)
    assert (stats["small"]["realised_share"], stats["small"]["realised_epochs"]) == (0.3, 20.0)  # 600 / 2000; 600 / 30 unique
    assert stats["small"]["planned_epochs"] == pytest.approx(0.3 * 2000 / 30)
    small = [i for name, i in stream if name == "small"]
    assert [sorted(small[e * 10:(e + 1) * 10]) for e in range(20)] == [list(range(10))] * 20  # each of 20 epochs reads all 10 once


def test_mixture_widget_reacts_to_sliders():
    widget = MixtureWidget([Source("problems", 0.6, 1000), Source("prose", 0.4, 5000)], budget=10000, warn_at=5)
    assert "problems (6.0)" in widget.message.value
    widget.budget.value = 5000
    assert "within range" in widget.message.value
    widget.shares["prose"].value = 0.9
    assert "shares sum to 1.50" in widget.message.value
    sources, budget = widget.current()
    assert sum(s.share for s in sources) == pytest.approx(1.0) and budget == pytest.approx(5000)


def test_money_problems_that_no_bill_covers_ask_for_the_spending():
    "A total above the largest bill ($200) once raised StopIteration; such problems now ask how much was spent."
    import random

    from slm_bench.data.synth import TRAIN_VOCAB, _value, fam_money

    large = [spec for spec in (fam_money(random.Random(seed), TRAIN_VOCAB) for seed in range(4000)) if _value(spec.steps)["total"] > 200]
    assert large, "no seed drew a total above $200"
    assert all(spec.ask.startswith("How much does") and "bill" not in " ".join(spec.sentences) for spec in large)
