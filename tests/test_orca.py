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


# ---- issue 53: the controls of Orca 2's findings, each planted with a known answer ----

class EchoSampler:
    "A stand-in sampler: records every prompt it is given and answers each with a fixed text."

    def __init__(self, text: str = "#### 1"):
        self.prompts, self.text = [], text

    def generate(self, prompts, params):
        from types import SimpleNamespace

        self.prompts += [list(p) for p in prompts]
        return [[SimpleNamespace(text=self.text)] for _ in prompts]


def test_progressive_and_mixed_hold_the_same_rows_each_once_and_differ_in_order_alone(problems):
    "order_arms: the same multiset of packed rows (so of records) in both arms, the same phase sizes; progressive's first phase all weak."
    from collections import Counter

    from slm_bench.lm.packing import pack
    from slm_bench.lm.tokenizer import train_tokenizer
    from slm_bench.methods.orca import order_arms, student_examples

    weak = per_task_records(WEAK_TEACHER.records(problems, ["cot"], seed=1), {p.family: "cot" for p in problems})
    strong = per_task_records(STRONG_TEACHER.records(problems, ["program"], seed=2), {p.family: "program" for p in problems})
    tokenizer = train_tokenizer([r["user"] + "\n" + r["answer"] for r in weak + strong], vocab_size=320)
    rows = lambda records: pack(student_examples(tokenizer, records), seq_len=1024, pad_id=tokenizer.pad_token_id, mode="greedy")
    weak_rows, strong_rows = rows(weak), rows(strong)
    assert not set(map(lambda row: tuple(row["input_ids"]), weak_rows)) & set(map(lambda row: tuple(row["input_ids"]), strong_rows))
    arms = order_arms(weak_rows, strong_rows, first_steps=3, steps=5, micro_batch_size=4, seed=7)
    key = lambda row: tuple(row["input_ids"])
    (p1, p2), (m1, m2) = arms["progressive"], arms["mixed"]
    assert (len(p1), len(p2), len(m1), len(m2)) == (12, 8, 12, 8)  # 3 weak steps then 2 strong, 4 rows a step; mixed cut at the same row
    assert Counter(map(key, p1 + p2)) == Counter(map(key, m1 + m2))  # the same rows, the same number of times
    assert len(set(map(key, p1 + p2))) == 20  # each drawn row once
    weak_keys = set(map(key, weak_rows))
    assert [key(r) in weak_keys for r in p1 + p2] == [True] * 12 + [False] * 8  # progressive: every weak row, then every strong row
    assert sum(key(r) in weak_keys for r in m1 + m2) == 12 and 0 < sum(key(r) in weak_keys for r in m1) < 12  # mixed: the same share, mixed
    again = order_arms(weak_rows, strong_rows, first_steps=3, steps=5, micro_batch_size=4, seed=7)
    assert [list(map(key, a)) for a in again["mixed"]] == [list(map(key, a)) for a in arms["mixed"]]  # seeded
    with pytest.raises(BadInput, match="the second phase needs 400 packed rows"):
        order_arms(weak_rows, strong_rows, first_steps=1, steps=101, micro_batch_size=4)


def test_a_rows_phase_runs_each_row_once_and_resumes(problems, tmp_path):
    "Given rows, a phase's steps are rows / micro-batch and the next phase starts from its checkpoint; a ragged phase is refused."
    from transformers import AutoModelForCausalLM

    from slm_bench.lm.models import create_model, get_preset, save_checkpoint
    from slm_bench.lm.packing import pack
    from slm_bench.lm.tokenizer import train_tokenizer
    from slm_bench.methods.orca import order_arms, student_examples
    from slm_bench.methods.tinygsm import sft_config

    records = [erase(r) for r in STRONG_TEACHER.records(problems[:60], ["cot"], seed=0)]
    tokenizer = train_tokenizer([r["user"] + "\n" + r["answer"] for r in records], vocab_size=320)
    preset = get_preset("llama-0.5m", vocab_size=len(tokenizer), max_position_embeddings=1024)
    save_checkpoint(create_model(preset, pad_token_id=tokenizer.pad_token_id), tokenizer, tmp_path / "base")
    rows = pack(student_examples(tokenizer, records), seq_len=1024, pad_id=tokenizer.pad_token_id, mode="greedy")
    arms = order_arms(rows[:len(rows) // 2], rows[len(rows) // 2:], 1, 2, 2, seed=0)
    config = sft_config(1, 2, 1e-3, 0, progress=False)
    summary = train_curriculum(tmp_path / "base", tokenizer, [Phase("weak", [], rows=arms["progressive"][0]), Phase("strong", [], rows=arms["progressive"][1])],
                               config, tmp_path / "progressive", seq_len=1024)
    assert [(s["phase"], s["rows"], s["steps"], s["records"], s["epochs"]) for s in summary] == [("weak", 2, 1, None, 1.0), ("strong", 2, 1, None, 1.0)]
    assert summary[1]["start"] == weights_fingerprint(AutoModelForCausalLM.from_pretrained(summary[0]["checkpoint"]))
    with pytest.raises(BadInput, match="has 3 rows, not a whole number of micro-batches of 2"):
        train_curriculum(tmp_path / "base", tokenizer, [Phase("odd", [], rows=rows[:3])], config, tmp_path / "odd")


def test_the_empty_message_control_has_the_erasure_records_but_for_the_system_message(problems):
    "The same problems, strategies, answers and few-shot draws; only the erased instruction differs ('' against the cautious one)."
    records = STRONG_TEACHER.records(problems, list(STRATEGIES), seed=0)
    choice = {p.family: ["guess", "cot"] for p in problems}
    build = lambda system: (lambda erased: erased + few_shot_records(erased, 0.2, seed=3))(per_task_records(records, choice, system=system))
    cautious, empty = build(CAUTIOUS_SYSTEM), build("")
    strip = lambda r: {k: v for k, v in r.items() if k != "system"}
    assert len(cautious) == len(empty) == len(problems) + round(0.2 * len(problems))
    assert [strip(r) for r in cautious] == [strip(r) for r in empty]
    assert {r["system"] for r in cautious} == {CAUTIOUS_SYSTEM} and {r["system"] for r in empty} == {""}


def test_the_one_turn_control_asks_the_second_turns_task_in_a_first_turn(problems):
    "The same k and gold as the dialogue's second turn; the follow-up appended to the problem; no earlier turn in the prompt."
    from slm_bench.methods.orca import follow_ups, one_turn_follow_ups, second_turns

    chosen = problems[:6]
    dialogue, alone = EchoSampler(), EchoSampler()
    turns = second_turns(dialogue, chosen, [{"answer": "#### 0"}] * 6, CAUTIOUS_SYSTEM, seed=3)
    control = one_turn_follow_ups(alone, chosen, CAUTIOUS_SYSTEM, seed=3)
    assert [c["gold"] for c in control] == [t["gold"] for t in turns] == [g for _, g in follow_ups(chosen, seed=3)]
    assert [len(p) for p in dialogue.prompts] == [4] * 6 and [len(p) for p in alone.prompts] == [2] * 6
    assert [p[1]["content"] for p in alone.prompts] == [f"{q.question}\n{t['question']}" for q, t in zip(chosen, turns)]
    assert {p[0]["content"] for p in alone.prompts} == {CAUTIOUS_SYSTEM}


def test_each_problem_can_carry_its_own_system_message(problems):
    "The probe told each family's chosen strategy: one instruction per problem, in order; a count that does not match is refused."
    from slm_bench.methods.orca import answer_problems, best_single_strategy, chosen_instructions

    sampler = EchoSampler()
    chosen = problems[:10]
    told = chosen_instructions(chosen, {p.family: ["guess", "direct"] for p in chosen}, "program")
    answer_problems(sampler, chosen, told)
    expected = [STRATEGIES["guess" if STRATEGIES["guess"].fits(problem_steps(p)) else "direct"].instruction for p in chosen]
    assert [p[0]["content"] for p in sampler.prompts] == expected
    with pytest.raises(BadInput, match="9 system messages for 10 problems"):
        answer_problems(sampler, chosen, told[:9])
    accuracy = {"add": {"direct": {"accuracy": 0.3, "n": 10}, "program": {"accuracy": 0.4, "n": 10}, "guess": {"accuracy": 1.0, "n": 3}},
                "chain": {"direct": {"accuracy": 0.5, "n": 10}, "program": {"accuracy": 0.3, "n": 10}}}
    assert best_single_strategy(accuracy) == "direct"  # 8 of 20 against the program's 7 of 20; guess was not asked on every problem


@pytest.mark.parametrize("claim_id, experiment, control, verdict", [
    ("orca2.progressive_learning", [1, 0] * 20, [1, 0] * 20, "inconclusive"),  # identical arms: zero effect
    ("orca2.progressive_learning", [1] * 30 + [0] * 10, [1] * 10 + [0] * 30, "reproduced"),  # progressive right on 20 more problems
    ("orca2.cautious_over_empty", [1] * 10 + [0] * 30, [1] * 30 + [0] * 10, "contradicted"),
    ("orca2.cautious_more_hallucination", [0, 1] * 20, [0, 1] * 20, "inconclusive"),
    ("orca2.second_turn_lower", [3.0] * 40, [9.0] * 40, "reproduced"),  # second turns graded lower than the same task asked first
    ("orca2.second_turn_lower", [9.0] * 40, [9.0] * 40, "inconclusive"),
])
def test_the_reworked_findings_flip_with_planted_scores(claim_id, experiment, control, verdict):
    "Each reworked comparison through the ledger: equal arms give exactly 0 and inconclusive; a planted gap gives its verdict."
    from slm_bench.core.claims import claim
    from slm_bench.evals.findings import Finding

    finding = Finding.paired("planted", claim(claim_id), "experiment", "control", (experiment, control))
    assert finding.verdict == verdict
    expected = (sum(experiment) - sum(control)) / len(experiment)
    assert finding.effect["difference"] == pytest.approx(expected)
    if experiment == control:
        assert (finding.effect["difference"], finding.effect["ci_low"], finding.effect["ci_high"]) == (0.0, 0.0, 0.0)
