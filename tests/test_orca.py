"""Orca 2's pieces against known answers: every strategy's format read back, prompt erasure, the choice rule, the few-shot
builder, the curriculum's resume, the LLM teacher and judge through a real `slm-bench serve`, and the rule-based judge."""
import pytest

from conftest import save_wide_checkpoint, served_checkpoint
from slm_bench.core.errors import BadInput
from slm_bench.data.synth import ProceduralTeacher
from slm_bench.evals.judge import JudgeItem, RuleJudge, SamplerJudge, grade_turns, length_bias, parse_rating, position_bias
from slm_bench.evals.sandbox import Sandbox
from slm_bench.methods.orca import (Phase, choose_strategies, erase, few_shot_records, per_task_records, single_strategy_records,
                                    train_curriculum, weights_fingerprint)
from slm_bench.methods.orca_strategies import (CAUTIOUS_SYSTEM, STRATEGIES, STRONG_TEACHER, WEAK_TEACHER, _value, check_teacher_records,
                                               get_strategy, judge_answers, llm_teacher_records, problem_steps, strategy_of)


@pytest.fixture(scope="module")
def problems():
    return ProceduralTeacher(error_rate=0.0, irrelevant_rate=0.33, mode="two-stage").generate(150, seed=4)


def test_every_strategy_strong_and_weak_reads_back_to_the_value_of_its_steps(problems):
    "The one parser reads every format (programs run in the sandbox) and finds the number the written steps compute."
    texts, expected, names = [], [], []
    for teacher in (STRONG_TEACHER, WEAK_TEACHER):
        for r in teacher.records(problems, list(STRATEGIES), seed=1):
            texts.append(r["answer"])
            expected.append(r["gold"] if not r["slipped"] else None)
            names.append(r["strategy"])
    with Sandbox() as box:
        verdicts = judge_answers([e if e is not None else 10**9 for e in expected], texts, box)
    assert set(names) == set(STRATEGIES)
    assert all(v.extracted is not None for v in verdicts)  # Format-OK for every strategy, both teachers
    assert [v.correct for v, e in zip(verdicts, expected) if e is not None] == [True] * sum(e is not None for e in expected)
    assert {strategy_of(t) for t, n in zip(texts, names) if n != "recall"} <= set(STRATEGIES)


def test_slips_are_planted_at_the_teachers_rates(problems):
    "The weak teacher slips about five times as often as the strong one; a slipped answer is wrong, a clean one right."
    strong = STRONG_TEACHER.records(problems * 4, ["cot"], seed=3)
    weak = WEAK_TEACHER.records(problems * 4, ["cot"], seed=3)
    assert 0.02 <= sum(r["slipped"] for r in strong) / len(strong) <= 0.09
    assert 0.18 <= sum(r["slipped"] for r in weak) / len(weak) <= 0.32
    with Sandbox() as box:
        kept, dropped = check_teacher_records(weak, box)
    assert dropped == [] and [r["teacher_correct"] for r in kept] == [not r["slipped"] for r in weak]


def test_an_unknown_strategy_and_an_unreadable_answer_are_clear(problems):
    with pytest.raises(BadInput, match="unknown strategy 'tree_of_thought'; the library has: direct, program, cot, recall, explain, guess"):
        get_strategy("tree_of_thought")
    records = STRONG_TEACHER.records(problems[:3], ["program", "cot"], seed=0)
    records[1] = {**records[1], "answer": "It is 42, I think."}
    kept, dropped = check_teacher_records(records)
    assert [r["id"] for r in dropped] == [records[1]["id"]] and dropped[0]["why"] == "not in the 'cot' format"
    assert [r["id"] for r in kept] == [r["id"] for i, r in enumerate(records) if i != 1]


def test_guess_and_check_fits_exactly_the_problems_whose_last_step_is_an_exact_division(problems):
    import re
    from fractions import Fraction

    fitting = 0
    for p in problems:
        steps = problem_steps(p)
        env = _value(steps)
        value = lambda token: env[token] if token in env else Fraction(token)
        division = re.fullmatch(r"(\w+) (//|/) (\w+)", steps[-1].expr)
        exact = bool(division) and value(division.group(3)) > 1 and value(division.group(1)) % value(division.group(3)) == 0
        assert STRATEGIES["guess"].fits(steps) == exact, p.question
        if exact:
            fitting += 1
            text = STRATEGIES["guess"].write(steps)
            assert text.endswith(f"right.\n#### {env[steps[-1].var]}") and text.count("Try") in (1, 2)
        else:
            with pytest.raises(BadInput, match="does not fit"):
                STRATEGIES["guess"].write(steps)
    assert 0 < fitting < len(problems)


def test_prompt_erasure_replaces_only_the_system_message(problems):
    record = STRONG_TEACHER.records(problems[:1], ["recall"], seed=0)[0]
    erased = erase(record, "Be careful.")
    assert erased == {**record, "system": "Be careful.", "teacher_system": STRATEGIES["recall"].instruction}
    assert [r["system"] for r in single_strategy_records([record], "recall")] == [CAUTIOUS_SYSTEM]
    with pytest.raises(BadInput, match="already erased"):
        erase(erased)


def test_the_choice_rule_on_a_hand_made_table():
    ids = [f"q{i}" for i in range(30)]
    table = {
        "add": {"direct": dict(zip(ids, [True] * 28 + [False] * 2)), "program": dict.fromkeys(ids, True)},  # tied: the cheaper direct
        "chain": {"direct": dict.fromkeys(ids, False), "cot": dict(zip(ids, [True] * 9 + [False] * 21)),
                  "program": dict(zip(ids, [True] * 20 + [False] * 10))},  # program clearly best
        "divide": {"guess": dict(zip(ids[:10], [True] * 10)), "program": dict(zip(ids, [True] * 12 + [False] * 18))},  # guess on its subset
    }
    cost = {"direct": 4, "cot": 50, "program": 45, "guess": 40}
    choices = choose_strategies(table, cost)
    assert {f: c.strategy for f, c in choices.items()} == {"add": "direct", "chain": "program", "divide": "guess"}
    assert choices["chain"].ranking == ["program", "cot", "direct"]
    assert {f: c.strategy for f, c in choose_strategies(table, cost, rule="best").items()} == {"add": "program", "chain": "program", "divide": "guess"}
    with pytest.raises(BadInput, match="task family 'ages' has no dev problems"):
        choose_strategies({"ages": {"direct": {}, "program": {}}}, cost)


def test_per_task_records_fall_back_where_the_choice_does_not_fit(problems):
    records = STRONG_TEACHER.records(problems, ["guess", "program"], seed=0)
    chosen = per_task_records(records, {p.family: ["guess", "program"] for p in problems})
    assert len(chosen) == len(problems)
    fits = {p.id: STRATEGIES["guess"].fits(problem_steps(p)) for p in problems}
    assert [r["strategy"] for r in chosen] == ["guess" if fits[r["problem_id"]] else "program" for r in chosen]
    assert {r["system"] for r in chosen} == {CAUTIOUS_SYSTEM}


def test_few_shot_demonstrations_come_from_the_same_task_and_instruction(problems):
    records = STRONG_TEACHER.records(problems, ["direct", "cot"], seed=0)
    shots = few_shot_records(records, share=0.2, shots=(3, 5), seed=2, length=len, max_tokens=900)
    assert len(shots) >= 0.15 * len(records)
    for r in shots:
        blocks = r["user"].split("\n\n")
        demos = [b.removeprefix("Question: ").split("\nAnswer: ") for b in blocks[:-1]]
        group = {(x["user"], x["answer"]) for x in records if (x["family"], x["system"]) == (r["family"], r["system"]) and x["user"] != blocks[-1].removeprefix("Question: ")}
        assert 3 <= r["shots"] == len(demos) <= 5 and all(tuple(d) in group for d in demos)
        assert len(r["user"] + r["answer"]) <= 900
    with pytest.raises(BadInput, match="few-shot share must be in"):
        few_shot_records(records, share=1.5)


def test_progressive_phases_resume_from_the_last_checkpoint(problems, tmp_path):
    "Phase 2 starts from phase 1's saved weights, not from the base; every phase runs its own steps."
    from transformers import AutoModelForCausalLM

    from slm_bench.lm.models import create_model, get_preset, save_checkpoint
    from slm_bench.lm.tokenizer import train_tokenizer
    from slm_bench.methods.tinygsm import sft_config

    records = STRONG_TEACHER.records(problems[:40], ["cot"], seed=0)
    tokenizer = train_tokenizer([r["user"] + "\n" + r["answer"] for r in records], vocab_size=320)
    preset = get_preset("llama-0.5m", vocab_size=len(tokenizer), max_position_embeddings=1024)
    save_checkpoint(create_model(preset, pad_token_id=tokenizer.pad_token_id), tokenizer, tmp_path / "base")
    base = weights_fingerprint(AutoModelForCausalLM.from_pretrained(tmp_path / "base"))
    phases = [Phase("weak", WEAK_TEACHER.records(problems[40:60], ["cot"], seed=1), steps=2), Phase("strong", records, steps=3)]
    summary = train_curriculum(tmp_path / "base", tokenizer, phases, sft_config(1, 4, 1e-3, 0, progress=False), tmp_path / "cur", seq_len=1024)
    assert [(s["phase"], s["steps"]) for s in summary] == [("weak", 2), ("strong", 3)]
    assert summary[0]["start"] == base
    assert summary[1]["start"] == weights_fingerprint(AutoModelForCausalLM.from_pretrained(summary[0]["checkpoint"])) != base
    with pytest.raises(BadInput, match="curriculum phase 1 \\('weak'\\) has no records"):
        train_curriculum(tmp_path / "base", tokenizer, [Phase("weak", [])], sft_config(1, 4, 1e-3, 0, progress=False), tmp_path / "x")


def test_the_rule_judge_grades_hallucinations_and_has_no_position_or_length_bias():
    question = "Ava buys 3 boxes of pens with 4 in each. She gives away 5 pens. How many pens does Ava have?"
    replies = ["Pens: 3 * 4 = <<3*4=12>>12.\nLeft: 12 - 5 = <<12-5=7>>7.\n#### 7",
               "def simple_math_problem() -> int:\n    boxes = 3\n    per_box = 6\n    pens = boxes * per_box\n    return pens - 11",
               "We know: boxes = 3, per box = 4, given = 5.\n3 * 4 = 12\n12 - 5 = 7\n#### 8", "no idea"]
    with Sandbox() as box:
        judge = RuleJudge(box)
        items = [JudgeItem(question, r, gold=7) for r in replies]
        assert judge.hallucinated(items) == [False, True, False, False]  # 6 and 11 are in neither the question nor the givens
        assert judge.grade(items) == [9.0, 6.0, 3.0, 1.0]
        assert position_bias(judge, items[:2], items[2:]) == {"pairs": 2, "unparsed": 0, "consistent": 1.0, "prefers_first": 0.0, "prefers_second": 0.0}
        assert length_bias(judge, items) == {"pairs": 4, "grade_gain": 0.0, "longer_wins": 0.0, "shorter_wins": 0.0, "ties": 1.0}
        follow = JudgeItem(question + "\n" + replies[0] + "\nThere are 2 more. Now?", "#### 9", gold=9)
        assert grade_turns(judge, [[items[0], follow], [items[3]]]) == {"turn_1": 5.0, "turn_2": 9.0, "average": 19 / 3, "ungraded": 0}
    assert judge.pin()["kind"] == "rule-based"


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory, problems):
    "An untrained 1,024-token model, its tokenizer trained on the strategies' records."
    records = STRONG_TEACHER.records(problems, list(STRATEGIES), seed=0)
    texts = [r["system"] + "\n" + r["user"] + "\n" + r["answer"] for r in records]
    return save_wide_checkpoint(tmp_path_factory.mktemp("wide") / "model", texts)


@pytest.fixture(scope="module")
def served(wide_checkpoint):
    "A real `slm-bench serve` of that checkpoint: its URL."
    with served_checkpoint(wide_checkpoint) as url:
        yield url


def test_an_llm_teacher_and_an_llm_judge_through_a_real_server(served, wide_checkpoint, problems):
    "Every fitting (problem, strategy) is asked; an answer is kept exactly when its strategy's format reads it; the judge's grades are its replies parsed."
    from transformers import AutoTokenizer

    from slm_bench.infer.http import HTTPSampler
    from slm_bench.infer.sampling import SamplingParams

    sampler = HTTPSampler(served, "tiny", tokenizer=AutoTokenizer.from_pretrained(wide_checkpoint), max_context=1024, retries=1, backoff=0.05)
    chosen = problems[:4]
    records, dropped = llm_teacher_records(sampler, chosen, ["direct", "guess"], teacher="tiny", max_new_tokens=12)
    asked = sum(1 + STRATEGIES["guess"].fits(problem_steps(p)) for p in chosen)
    assert len(records) + len(dropped) == asked
    assert all(get_strategy(r["strategy"]).readable(r["answer"]) for r in records)
    assert all(not get_strategy(d["strategy"]).readable(d["answer"]) and d["why"] == f"not in the {d['strategy']!r} format" for d in dropped)
    judge = SamplerJudge(sampler, model="tiny", version="test-1", max_new_tokens=12)
    items = [JudgeItem("Ann has 2 pens and buys 3. How many?", "#### 5"), JudgeItem("Bo has 4 cups and breaks 1. How many?", "#### 2")]
    prompts = [[{"role": "user", "content": judge.rubrics["single@1"].format(question=i.question, answer=i.answer)}] for i in items]
    raw = [g[0].text for g in sampler.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))]
    assert judge.grade(items) == [parse_rating(r) for r in raw]
    assert judge.pin()["model"] == "tiny" and judge.pin()["version"] == "test-1" and set(judge.pin()["rubrics"]) == {"single@1", "pairwise@1", "grounding@1", "aspects@1"}
