"""Tasks and the `slm-bench score` CLI on the real benchmark data (shipped with the package; AMC23, not shipped, is skipped with a reason when absent)."""
import gzip
import json
import time

import pytest

from conftest import tree
from slm_bench.evals.metrics import amc_score
from slm_bench.evals.sandbox import Sandbox
from slm_bench.evals.tasks import benchmark_file, get_task, normalize_latex, packaged_data_dir

needs_amc = pytest.mark.skipif(benchmark_file("amc") is None, reason="AMC23 is not shipped (its collection states no license): "
                               "set SLM_BENCH_DATA to a folder holding amc23/test.jsonl")


def test_benchmark_files_ship_with_the_package_and_slm_bench_data_overrides(tmp_path, monkeypatch):
    monkeypatch.delenv("SLM_BENCH_DATA", raising=False)
    assert benchmark_file("gsm8k") == packaged_data_dir() / "gsm8k" / "test.jsonl.gz"
    assert len(get_task("gsm8k").load()) == 1319
    assert (packaged_data_dir() / "gsm8k" / "LICENSE").read_text().startswith("MIT License")
    mine = tmp_path / "gsm8k" / "test.jsonl"
    mine.parent.mkdir()
    mine.write_text('{"question": "1 + 1?", "answer": "#### 2"}\n')
    monkeypatch.setenv("SLM_BENCH_DATA", str(tmp_path))
    assert benchmark_file("gsm8k") == mine
    assert [p.gold for p in get_task("gsm8k").load()] == [2]


@pytest.fixture(scope="module")
def box():
    with Sandbox() as sandbox:
        yield sandbox


def test_gsm8k_all_test_answers(box):
    for name in ("gsm8k", "gsm8k-strict"):
        task = get_task(name)
        problems = task.load()
        assert len(problems) == 1319
        final = [p.row["answer"].split("####")[-1].strip() for p in problems]
        assert all(task.judge(p, f"Reasoning...\n#### {f}").correct for p, f in zip(problems, final))
        assert not any(task.judge(p, f"#### {p.gold + 1}").correct for p in problems)
        assert not any(task.judge(p, f"#### {p.gold + 7}").correct for p in problems)
    assert get_task("gsm8k-strict").judge(problems[0], f"The answer is {problems[0].gold}").extracted is None  # no ####


def test_tinygsm_programs_on_gsm8k(box):
    task = get_task("tinygsm")
    problems = task.load()
    good = task.judge_many(problems, [f"    result = {p.gold}\n    return result\n" for p in problems], sandbox=box)
    assert all(j.correct for j in good)
    bad = task.judge_many(problems[:200], [f"    return {p.gold} + 1\n" for p in problems[:200]], sandbox=box)
    assert not any(j.correct for j in bad)
    crash = task.judge(problems[0], "    return 1 / 0\n", sandbox=box)
    assert not crash.correct and crash.error.startswith("ZeroDivisionError")


def test_math500_boxed_answers():
    task = get_task("math500")
    problems = task.load()
    assert len(problems) == 500
    assert all(task.judge(p, f"Therefore the answer is $\\boxed{{{p.gold}}}$.").correct for p in problems)
    # a wrong answer: the gold answer of another problem (the next one whose answer is written differently)
    wrong = []
    for i, p in enumerate(problems):
        j = (i + 250) % len(problems)
        while normalize_latex(problems[j].gold) == normalize_latex(p.gold):
            j = (j + 1) % len(problems)
        wrong.append((p, problems[j].gold, task.judge(p, f"$\\boxed{{{problems[j].gold}}}$")))
    assert not any(j.correct for _, _, j in wrong), [(p.gold, other) for p, other, j in wrong if j.correct][:5]
    assert task.judge(problems[0], "I give up").extracted is None


def test_svamp_answers():
    task = get_task("svamp")
    problems = task.load()
    assert len(problems) == 1000 and problems[0].question.endswith("?")
    assert all(task.judge(p, f"So the answer is {p.row['Answer']}").correct for p in problems)
    assert not any(task.judge(p, f"So the answer is {p.gold + 1}").correct for p in problems)


@needs_amc
def test_amc_answers_and_score():
    task = get_task("amc")
    problems = task.load()
    judged = [task.judge(p, f"$\\boxed{{{p.gold:g}}}$") for p in problems]
    assert all(j.correct for j in judged)
    outcomes = [[task.outcome(j), task.outcome(task.judge(p, "no idea"))] for p, j in zip(problems, judged)]
    score = amc_score(outcomes)
    assert score["run_scores"] == [150.0, 37.5] and score["score"] == 93.75
    assert score["two_sigma"] == pytest.approx(112.5)  # of the mean: 2 × sample sd (56.25·√2) / √2 runs


def test_humaneval_canonical_pass_and_broken_fail_through_the_cli(cli, tmp_path):
    rows = [json.loads(line) for line in gzip.open(benchmark_file("humaneval"), "rt")]
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"task_id": r["task_id"], "completion": r["canonical_solution"]}) + "\n" for r in rows))
    start = time.perf_counter()
    result = cli("score", "--task", "humaneval", "--samples", samples, "--k", "1")
    wall = time.perf_counter() - start
    assert result.returncode == 0, result
    metrics = json.loads(result.stdout)
    assert metrics["n"] == 164 and metrics["accuracy"] == 1.0 and metrics["pass@1"] == 1.0 and metrics["format_ok"] == 1.0
    scored = [json.loads(line) for line in (tmp_path / "samples_scored.jsonl").read_text().splitlines()]
    assert len(scored) == 164 and all(s["correct"] and s["error"] is None for s in scored)
    print(f"scoring 164 HumanEval canonical solutions: {wall:.2f} s wall (CLI, including startup)")

    broken = tmp_path / "broken.jsonl"
    broken.write_text("".join(json.dumps({"task_id": r["task_id"], "completion": "    return None\n"}) + "\n" for r in rows))
    metrics = json.loads(cli("score", "--task", "humaneval", "--samples", broken, "--out", tmp_path / "b.jsonl").stdout)
    assert metrics["accuracy"] == 0.0


def test_a_humaneval_completion_that_forges_its_report_fails_by_name():
    "The issue's forgery on HumanEval/0: a passing report written to fd 3, then exit 0, before any assert runs."
    forged = ("    return False\nimport posix, json\n"
              "posix.write(3, json.dumps({'ok': True, 'value': 'x', 'error': None, 'message': ''}).encode())\nposix._exit(0)\n")
    task = get_task("humaneval")
    problem = task.load()[0]
    with Sandbox(workers=1) as box:
        assert box.run(task.program(problem, forged)).ok  # as a whole program it "ran"; no verdict rests on that
        judged = task.judge(problem, forged, sandbox=box)
    assert (judged.correct, judged.error.split(":")[0]) == (False, "ForgedReport")


def test_pass_at_k_from_the_cli(cli, tmp_path):
    rows = [json.loads(line) for line in gzip.open(benchmark_file("humaneval"), "rt")][:10]
    lines = []
    for r in rows:  # 4 samples per problem, 1 correct: pass@1 = 0.25, pass@2 = 1 - C(3,2)/C(4,2) = 0.5
        lines += [{"task_id": r["task_id"], "completion": r["canonical_solution"]}] + [{"task_id": r["task_id"], "completion": "    pass\n"}] * 3
    samples = tmp_path / "s.jsonl"
    samples.write_text("".join(json.dumps(x) + "\n" for x in lines))
    metrics = json.loads(cli("score", "--task", "humaneval", "--samples", samples, "--k", "1,2,10").stdout)
    assert metrics["pass@1"] == pytest.approx(0.25) and metrics["pass@2"] == pytest.approx(0.5) and metrics["skipped_k"] == [10]
    # every problem is exactly 1/4 right, so any resample of problems gives 0.25: the interval resamples problems, not samples
    assert metrics["accuracy_ci95"] == [0.25, 0.25] and metrics["samples_per_problem"] == [4, 4]


def test_score_reports_pass_at_1_8_32_where_the_samples_allow(cli, tmp_path):
    "Without --k: pass@1 and pass@8 for 8 samples per problem (not pass@32); the interval is over the 2 problems."
    samples = tmp_path / "s.jsonl"  # GSM8K row 0's answer is 18: problem 0 right in 2 of 8 samples, problem 1 in none
    samples.write_text("".join(json.dumps({"idx": idx, "completion": f"#### {18 if idx == 0 and i < 2 else 5}"}) + "\n"
                               for idx in (0, 1) for i in range(8)))
    metrics = json.loads(cli("score", "--task", "gsm8k", "--samples", samples).stdout)
    assert metrics["pass@1"] == pytest.approx((2 / 8 + 0) / 2)
    assert metrics["pass@8"] == pytest.approx((1 + 0) / 2) and "pass@32" not in metrics and "skipped_k" not in metrics
    assert metrics["accuracy"] == 2 / 16 and metrics["accuracy_ci95"] == [0.0, 0.25]  # draws: {1, 1} → 0, {0, 0} → 4/16


@pytest.mark.parametrize("content, message", [
    ('{"idx": 0, "completion": "#### 18"}\n{"idx": 1, "completion": \n', "line 2: not valid JSON"),
    ('{"idx": 0, "completion": "#### 18"}\n{"idx": 99999, "completion": "x"}\n', "line 2: unknown problem idx 99999"),
    ('{"id": "nope", "completion": "x"}\n', "line 1: unknown problem id 'nope'"),
    ('{"idx": 0}\n', "line 1: no 'completion' string"),
    ('{"completion": "x"}\n', "line 1: the sample names no problem"),
])
def test_bad_samples(cli, tmp_path, content, message):
    samples = tmp_path / "samples.jsonl"
    samples.write_text(content)
    before = tree(tmp_path)
    result = cli("score", "--task", "gsm8k", "--samples", samples)
    assert result.returncode == 2 and message in result.stderr and str(samples) in result.stderr, result
    assert tree(tmp_path) == before  # no partial output


def test_data_of_the_wrong_shape(cli, tmp_path):
    samples = tmp_path / "s.jsonl"
    samples.write_text('{"task_id": "HumanEval/0", "completion": "x"}\n')
    result = cli("score", "--task", "humaneval", "--data", benchmark_file("gsm8k"), "--samples", samples)
    assert result.returncode == 2 and "does not look like humaneval data" in result.stderr, result
    assert cli("score", "--task", "nope", "--samples", samples).returncode == 2
    assert not (tmp_path / "s_scored.jsonl").exists()


def test_prompts():
    gsm = get_task("gsm8k")
    problem = gsm.load()[0]
    shots = gsm.load_shots(k=8)
    prompt = gsm.prompt(problem, "few-shot", shots)
    assert prompt.count("Question: ") == 9 and prompt.count("#### ") == 8 and prompt.endswith(f"Question: {problem.question}\nAnswer:")
    assert "<<" in prompt  # the training split's worked solutions keep their calculator annotations
    chat = gsm.prompt(problem, "chat", system="You are a careful tutor.")
    assert chat[0] == {"role": "system", "content": "You are a careful tutor."} and "#### <number>" in chat[1]["content"]
    tiny = get_task("tinygsm").prompt(problem)
    assert tiny.startswith("def simple_math_problem() -> int:\n    \"\"\"\n") and problem.question.split()[0] in tiny
    human = get_task("humaneval")
    h = human.load()[0]
    assert human.prompt(h) == h.row["prompt"]


def test_multiple_choice_extraction_and_loglik(tiny_checkpoint):
    from slm_bench.infer.sampling import HFSampler
    from slm_bench.evals.tasks import MultipleChoice, extract_choice, mcq_loglik_choice

    task = MultipleChoice()
    problem = task.problem(0, {"question": "Which is bigger?", "choices": ["one", "two", "three"], "answer": 2})
    assert problem.gold == "C" and "C. three" in task.question_text(problem)
    for text, letter in [("###Final answer: C", "C"), ("Reasoning... Final option: (b)", None), ("So, the answer is B.", "B"),
                         ("Final answer is A", "A"), ("It must be (C).", "C"), ("I cannot tell.", None)]:
        assert extract_choice(text, 3) == letter, text
    assert task.judge(problem, "Final answer: C").correct and not task.judge(problem, "Final answer: A").correct
    assert task.judge(problem, "no idea").extracted is None
    sampler = HFSampler.from_checkpoint(tiny_checkpoint)
    choice = mcq_loglik_choice(sampler, sampler.tokenizer, "Tom has 7 apples and buys 3 more, so he has",
                               ["zebra piano the of", "10 apples."])
    assert choice == 1
