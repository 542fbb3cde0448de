"""Phi-4's synthetic-data workflows (data.workflows): each with a scripted teacher whose replies are known, and each
through a real `slm-bench serve` endpoint."""
import random
from fractions import Fraction

import pytest

from conftest import save_wide_checkpoint, served_checkpoint
from slm_bench.data.synth import ParseReport, ProceduralTeacher, parse_joint
from slm_bench.data.workflows import (ChatAnnotator, ChatCritic, ChatInstructionWriter, ChatReviser, ChatRewriter, ChatTeacher,
                                      PHI4_PROMPTS, CodeInstructionWriter, RuleCritic, ValueClassifier, code_only, curate_seeds,
                                      parse_score, plurality_filter, reversal_gate, self_revise, teacher_answers, web_pages)
from slm_bench.infer.sampling import Completion

PROGRAM = ('def simple_math_problem() -> int:\n    """\n    Ava has 12 apples. She gets 5 more. How many apples does Ava have now?\n'
           '    """\n    start = 12\n    more = 5\n    return start + more\n')
QUESTION = "Ava has 12 apples. She gets 5 more. How many apples does Ava have now?"


class ScriptedSampler:
    "A Sampler whose reply to each user message is `script(message, sample_index)`: a teacher with known outputs, recording what it was asked."

    tokenizer, max_context = None, 4096

    def __init__(self, script):
        self.script, self.asked = script, []

    def generate(self, prompts, params):
        out = []
        for messages in prompts:
            text = messages[-1]["content"]
            self.asked.append(text)
            out.append([Completion([], self.script(text, j), [], "stop") for j in range(params.n)])
        return out


def test_an_llm_annotator_labels_by_its_scores_and_the_classifier_learns_them():
    "The annotator's 0-5 scores become labels at the cutoff (None unscored); the classifier fitted to them separates new passages."
    def script(prompt, _):
        passage = prompt.split("Passage:\n", 1)[1]
        return "Reasons.\nScore: [[5]]" if passage.startswith(("Worked", "Adding", "To share", "Multiplication")) else (
            "I cannot tell." if "Weather" in passage else "Junk.\nScore: [[1]]")
    sampler = ScriptedSampler(script)
    passages = [q for page in web_pages(120, seed=0) for q in page["passages"]]
    labels = ChatAnnotator(ChatTeacher(sampler)).label(passages)
    assert len(sampler.asked) == len(passages)
    assert sampler.asked[0] == PHI4_PROMPTS["educational_value@1"].format(text=passages[0]["text"])
    expected = [None if "Weather" in q["text"] else q["text"].startswith(("Worked", "Adding", "To share", "Multiplication")) for q in passages]
    assert labels == expected
    curated = curate_seeds(web_pages(40, seed=1), ValueClassifier().fit([q["text"] for q in passages], labels))
    assert all(q["score"] >= 0.5 for q in curated.kept) and len(curated.kept) + len(curated.dropped) == curated.passages
    assert curated.precision == 1.0  # the scripted teacher's labels are a clean rule the classifier can learn


def test_plurality_answers_from_a_scripted_teacher():
    "Programs are run and '#### n' read; unanimous, no-consensus and kept questions are sorted exactly, the plurality answer kept."
    replies = {"q-easy": ["#### 4"] * 4, "q-split": ["#### 7", PROGRAM, "#### 7", "no answer"], "q-lost": ["#### 1", "#### 2", "#### 3", "oops"]}
    sampler = ScriptedSampler(lambda prompt, j: replies[prompt.split("Problem:\n", 1)[1].strip()][j])
    questions = [{"question": "q-easy", "answer": 4}, {"question": "q-split", "answer": 7}, {"question": "q-lost", "answer": 1}]
    answers, texts = teacher_answers(ChatTeacher(sampler, temperature=1.0), [q["question"] for q in questions], 4)
    assert answers == [[Fraction(4)] * 4, [Fraction(7), Fraction(17), Fraction(7), None], [Fraction(1), Fraction(2), Fraction(3), None]]
    kept, summary = plurality_filter(questions, answers, texts)
    assert summary == {"questions": 3, "kept": 1, "unanimous": 1, "no_consensus": 1, "tie": 0, "weak": 0, "agreement": 1.0}
    assert [(r["question"], r["answer"], r["program"], r["share"]) for r in kept] == [("q-split", 7, "#### 7", 0.5)]


def test_a_scripted_rewriter_keeps_the_exercises_that_run():
    "Each ### PROBLEM block with a function is an exercise whose answer is its program's value; a block without one is dropped."
    seed = ProceduralTeacher(error_rate=0.0, irrelevant_rate=0.0, families=("add",)).generate(1, seed=0)[0]
    variant = PROGRAM.replace("12 apples", "20 apples").replace("start = 12", "start = 20")
    reply = f"### PROBLEM\n```python\n{variant}```\n### PROBLEM\nI forgot the code.\n### PROBLEM\n{PROGRAM}"
    sampler = ScriptedSampler(lambda prompt, _: reply)
    records, report = ChatRewriter(ChatTeacher(sampler), variants=2, harder_versions=1).rewrite([seed])
    assert sampler.asked == [PHI4_PROMPTS["rewrite@1"].format(program=seed.program, variants=2, harder=1)]
    assert [(r["question"], r["answer"], r["seed_id"]) for r in records] == [
        (QUESTION.replace("12", "20"), 25, seed.id), (QUESTION, 17, seed.id)]
    assert (report.kept, report.dropped) == (2, 1)


def test_self_revision_with_a_scripted_critic_and_reviser():
    "The loop stops at the threshold: a draft the critic passes is not revised; another is revised until it passes; a third hits the round limit."
    wrong, worse = PROGRAM.replace("start + more", "start - more"), PROGRAM.replace("start + more", "start * more")

    def script(prompt, _):
        if prompt.startswith("You review"):
            draft = prompt.split("Solution:\n", 1)[1]
            return ("Fine.\nScore: [[10]]" if "start + more" in draft else "- subtracts: add instead\nScore: [[4]]" if "start - more" in draft
                    else "- multiplies: subtract instead\nScore: [[2]]")
        draft = prompt.split("Solution:\n", 1)[1].split("\n\nReview:")[0]
        return f"```python\n{PROGRAM if 'start - more' in draft else wrong}```"  # fixes the subtraction; turns the product into a subtraction
    teacher = ChatTeacher(ScriptedSampler(script))
    items = [{"question": QUESTION, "draft": d} for d in (PROGRAM, wrong, worse)]
    state, summary = self_revise(items, ChatCritic(teacher), ChatReviser(teacher), threshold=9, max_rounds=1)
    assert [s["scores"] for s in state] == [[10.0], [4.0, 10.0], [2.0, 4.0]]
    assert state[1]["notes"][0] == ["- subtracts: add instead"]
    assert summary == {"items": 3, "rounds": 2, "mean_score_by_round": [round(16 / 3, 4), 8.0], "passing": 2 / 3, "passing_first": 1 / 3,
                       "improved": 2 / 3}


def test_the_rule_critic_scores_by_its_rubric():
    "5 for a number, 4 pro rata for the givens used, 1 for a whole non-negative answer; a reference is never read."
    halves = PROGRAM.replace("return start + more", "return start / 8")
    crits = RuleCritic().critique([{"question": QUESTION, "draft": PROGRAM, "reference": 17},
                                   {"question": QUESTION, "draft": halves, "reference": 17},
                                   {"question": QUESTION, "draft": PROGRAM, "reference": None}])
    assert [c.score for c in crits] == [10.0, 5 + 4 + 0, 10.0]  # halves: defines both givens, returns 1.5
    assert crits[1].notes == ["- the answer 1.5 is not a whole, non-negative number: check each operation"]


def test_instruction_reversal_with_a_scripted_writer_and_coder():
    "The writer sees the code without its docstring; a regenerated program is kept only when it returns the original's value."
    def script(prompt, _):
        if prompt.startswith("Here is a Python function"):
            return "  Ava has 12 apples.\nShe gets 5 more. How many apples?  "
        return PROGRAM if "12 apples" in prompt else "no code"
    sampler = ScriptedSampler(script)
    teacher = ChatTeacher(sampler)
    told = ChatInstructionWriter(teacher).instructions([{"question": QUESTION, "program": PROGRAM}])
    assert sampler.asked[0] == PHI4_PROMPTS["instruction@1"].format(code=code_only(PROGRAM)) and '"""' not in sampler.asked[0]
    assert told == [{"instruction": "Ava has 12 apples. She gets 5 more. How many apples?", "faithful": None}]
    regenerated = [g[0] for g in teacher_answers(teacher, [told[0]["instruction"], "something else"], 1)[1]]
    gate = reversal_gate([PROGRAM, PROGRAM], regenerated)
    assert [(g["original_value"], g["regenerated_value"], g["kept"]) for g in gate] == [(17, 17, True), (17, None, False)]


def test_the_embedded_instruction_writer_misstates_at_its_slip_rate():
    records = [{"question": p.question, "program": p.program} for p in ProceduralTeacher(error_rate=0.0).generate(400, seed=1)]
    told = CodeInstructionWriter(slip=0.25, seed=3).instructions(records)
    faithful = CodeInstructionWriter(slip=0.0, seed=3).instructions(records)
    misstated = [t for t in told if not t["faithful"]]
    assert 70 <= len(misstated) <= 130  # 100 expected; binomial sd 8.7
    assert all(t["instruction"] != f["instruction"] for t, f in zip(told, faithful) if not t["faithful"])
    assert all(t["instruction"] == f["instruction"] for t, f in zip(told, faithful) if t["faithful"])
    assert all(r["question"] not in t["instruction"] for t, r in zip(told, records))


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    "An untrained 1,024-token model, its tokenizer trained on the templates and the world."
    problems = ProceduralTeacher(error_rate=0.0).generate(200, seed=0)
    texts = list(PHI4_PROMPTS.values()) + [p.program for p in problems]
    return save_wide_checkpoint(tmp_path_factory.mktemp("wide") / "model", texts)


@pytest.fixture(scope="module")
def served(wide_checkpoint):
    with served_checkpoint(wide_checkpoint) as url:
        yield url


def test_every_workflow_through_a_real_server(served, wide_checkpoint):
    "A model behind `slm-bench serve` takes every role through the shipped templates; what each workflow keeps is its replies parsed."
    from transformers import AutoTokenizer

    from slm_bench.infer.http import HTTPSampler
    from slm_bench.infer.sampling import SamplingParams
    from slm_bench.evals.answers import read_answers

    sampler = HTTPSampler(served, "tiny", tokenizer=AutoTokenizer.from_pretrained(wide_checkpoint), max_context=1024, retries=1, backoff=0.05)
    teacher = ChatTeacher(sampler, max_new_tokens=12)
    raw = lambda template, fields: [g[0].text for g in sampler.generate(
        [[{"role": "user", "content": PHI4_PROMPTS[template].format(**f)}] for f in fields], SamplingParams(temperature=0.0, max_new_tokens=12))]

    passages = [{"text": t, "educational": True} for t in ("Tom has 3 apples and gets 2 more: 3 + 2 = 5.", "Big sale! Shop now.")]
    labels = ChatAnnotator(teacher).label(passages)
    assert labels == [None if parse_score(r, 5) is None else parse_score(r, 5) >= 3 for r in raw("educational_value@1", passages)]

    questions = ["Tom has 3 apples and gets 2 more. How many apples?", "Ann has 5 pens and loses 1. How many pens?"]
    answers, replies = teacher_answers(teacher, questions, 2)
    assert [r[0] for r in replies] == raw("answer@1", [{"question": q} for q in questions])
    assert answers == [read_answers(r) for r in replies]

    seed = ProceduralTeacher(error_rate=0.0).generate(1, seed=0)[0]
    records, report = ChatRewriter(teacher).rewrite([seed])
    parsed = parse_joint(raw("rewrite@1", [{"program": seed.program, "variants": 2, "harder": 1}])[0], ParseReport())
    assert [(r["question"], r["program"]) for r in records] == [qp for qp, a in zip(parsed, read_answers([p for _, p in parsed])) if a is not None]

    items = [{"question": QUESTION, "draft": PROGRAM}]
    state, summary = self_revise(items, ChatCritic(teacher), ChatReviser(teacher), threshold=9, max_rounds=1)
    first = raw("critique@1", [{"question": QUESTION, "draft": PROGRAM}])[0]
    assert state[0]["scores"][0] == parse_score(first)
    assert len(state[0]["drafts"]) == (1 if (parse_score(first) or 0) >= 9 else 2)

    told = ChatInstructionWriter(teacher).instructions([{"question": QUESTION, "program": PROGRAM}])
    assert told[0]["instruction"] == " ".join(raw("instruction@1", [{"code": code_only(PROGRAM)}])[0].split())
