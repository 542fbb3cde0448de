"""Phi-4's self-revision and instruction reversal with controls (data.workflows, issue 54): the embedded critic, reviser
and instruction writer cannot read the answer they are judged on, and a critique that carries no information gives the
critique-guided reviser exactly its resampling control (a zero effect)."""
from slm_bench.data.synth import ProceduralTeacher
from slm_bench.data.workflows import (CodeInstructionWriter, Critique, CritiqueReviser, ResampleReviser, RuleCritic, self_revise)
from slm_bench.evals.findings import verdict_of
from slm_bench.evals.metrics import paired_difference_ci
from slm_bench.evals.answers import read_answers

PROBLEMS = ProceduralTeacher(error_rate=0.0, irrelevant_rate=0.0).generate(30, seed=11)


def misread(program: str) -> str:
    "The program with its first given literal changed (plus one)."
    import re
    return re.sub(r"(= )(\d+)\n", lambda m: f"{m.group(1)}{int(m.group(2)) + 1}\n", program, count=1)


def draw_from(by_question: dict):
    "A scripted SFT model: for each question, a misread program first, then the right one (repeated to k); records its calls."
    calls = []

    def draw(questions, k, seed):
        calls.append((tuple(questions), k, seed))
        return [([misread(by_question[q]), by_question[q]] * k)[:k] for q in questions]
    draw.calls = calls
    return draw


def test_the_critic_cannot_read_the_answer():
    "Each draft scores the same, with the same notes, whatever reference or true problem the item carries."
    drafts = [misread(p.program) for p in PROBLEMS] + [p.program for p in PROBLEMS]
    plain = RuleCritic().critique([{"question": p.question, "draft": d} for p, d in zip(PROBLEMS * 2, drafts)])
    for reference in (lambda p: p.answer, lambda p: p.answer + 1, lambda p: None):
        carried = RuleCritic().critique([{"question": p.question, "draft": d, "reference": reference(p), "problem": p, "truth": p.answer}
                                         for p, d in zip(PROBLEMS * 2, drafts)])
        assert [(c.score, c.notes) for c in carried] == [(c.score, c.notes) for c in plain]
    assert len({c.score for c in plain}) > 1  # the rubric does separate drafts


def test_the_reviser_cannot_read_the_true_program():
    "The guided reviser's output is identical whether or not the items carry the true problem, program and answer."
    draw = draw_from({p.question: p.program for p in PROBLEMS})
    items = [{"question": p.question, "draft": misread(p.program)} for p in PROBLEMS]
    critiques = RuleCritic().critique(items)
    bare = CritiqueReviser(draw, candidates=2).revise(items, critiques)
    carrying = CritiqueReviser(draw, candidates=2).revise(
        [{**i, "problem": p, "program": p.program, "reference": p.answer} for i, p in zip(items, PROBLEMS)], critiques)
    assert bare == carrying
    assert draw.calls[0] == draw.calls[1] == (tuple(p.question for p in PROBLEMS), 2, 0)  # it asks with the questions only


def test_the_writer_reads_the_code_only():
    "Two records with the same code and different questions get the same instruction, slip included."
    for slip in (0.0, 1.0):
        writer = CodeInstructionWriter(slip=slip, seed=5)
        for p in PROBLEMS[:10]:
            a, b = writer.instructions([{"question": p.question, "program": p.program},
                                        {"question": "How many pens does Ann have?", "program": p.program}])
            assert a == b and a["faithful"] is (slip == 0.0)
            assert p.question not in a["instruction"]


def test_a_critique_without_information_gives_a_zero_effect():
    "Planted: notes that say nothing → the guided reviser picks what resampling picks, item by item; the effect is 0, inconclusive."
    draw = draw_from({p.question: p.program for p in PROBLEMS})

    class SilentCritic:
        "A critic that fails every draft and says nothing useful."
        def critique(self, items):
            return [Critique(0.0, ["- try again"]) for _ in items]

    items = [{"question": p.question, "draft": misread(p.program)} for p in PROBLEMS]
    runs = {}
    for name, reviser in (("guided", CritiqueReviser(draw, candidates=2)), ("control", ResampleReviser(draw, candidates=2))):
        state, _ = self_revise(items, SilentCritic(), reviser, threshold=9.0, max_rounds=2)
        runs[name] = [s["drafts"][-1] for s in state]
    assert runs["guided"] == runs["control"]
    truth = [p.answer for p in PROBLEMS]
    correct = {k: [a is not None and a == t for a, t in zip(read_answers(v), truth)] for k, v in runs.items()}
    effect = paired_difference_ci(correct["guided"], correct["control"])
    assert effect["difference"] == 0.0 and verdict_of(effect, +1) == "inconclusive"


def test_an_informative_critique_beats_resampling():
    "Planted: the rule critic's notes point at the unused given, so the guided reviser picks the right program and the control does not."
    draw = draw_from({p.question: p.program for p in PROBLEMS})
    items = [{"question": p.question, "draft": misread(p.program)} for p in PROBLEMS]
    finals = {}
    for name, reviser in (("guided", CritiqueReviser(draw, candidates=2)), ("control", ResampleReviser(draw, candidates=2))):
        state, _ = self_revise(items, RuleCritic(), reviser, threshold=9.0, max_rounds=2)
        finals[name] = [a is not None and a == p.answer for a, p in zip(read_answers([s["drafts"][-1] for s in state]), PROBLEMS)]
    effect = paired_difference_ci(finals["guided"], finals["control"])
    assert sum(finals["guided"]) > sum(finals["control"]) and verdict_of(effect, +1) == "reproduced"


def test_the_endpoint_control_revises_without_the_review():
    "ChatReviser(read_critique=False) sends the same prompt with the review left empty; the guided one sends the notes."
    from slm_bench.data.workflows import PHI4_PROMPTS, ChatReviser, ChatTeacher
    from slm_bench.infer.sampling import Completion

    class Recording:
        tokenizer, max_context, asked = None, 4096, []

        def generate(self, prompts, params):
            self.asked += [m[-1]["content"] for m in prompts]
            return [[Completion([], "no code", [], "stop")] for _ in prompts]

    sampler, item = Recording(), {"question": "Q?", "draft": "def f(): pass"}
    note = Critique(3.0, ["- the program never uses 5 from the problem: use every quantity given"])
    for read in (True, False):
        assert ChatReviser(ChatTeacher(sampler), read_critique=read).revise([item], [note]) == [item["draft"]]
    assert sampler.asked == [PHI4_PROMPTS["revise@1"].format(question="Q?", draft=item["draft"], critique=c) for c in (note.notes[0], "(none)")]
