"""`slm-bench stages`, `recipes`, `profiles`, `report` and `bench`."""
import json

import pytest

from conftest import PIPELINES


def test_stages_lists_inputs_outputs_and_typed_parameters(cli):
    result = cli("stages")
    assert result.returncode == 0, result
    assert "environment  (common/00_environment.ipynb)" in result.stdout
    assert "outputs: environment.json, matmul.json, matmul.png" in result.stdout
    assert "sizes: list[int] = [256, 512, 1024, 2048]  # square matrix sizes" in result.stdout
    assert "run_dir: str = 'runs/lab'" in result.stdout and "[set by the runner]" in result.stdout

    listed = json.loads(cli("stages", "--pipeline", PIPELINES / "basic", "--json").stdout)
    assert [s["name"] for s in listed] == ["source", "double"]
    assert listed[1]["inputs"] == ["source"] and listed[1]["recipe"] == "basic"  # a flat folder is one recipe
    assert listed[1]["parameters"]["factor"] == {"type": "int", "default": 2, "help": "multiplier"}


def test_recipes_list_own_stages_and_what_they_need(cli):
    result = cli("recipes")
    assert result.returncode == 0, result
    assert result.stdout.splitlines() == [
        "common: environment, synth, curate, mixture, pretrain, sft",
        "llama2: chat_sft, preferences, reward_model, rejection_sampling, ppo, gatt, contamination, safety, rlhf_round2  (needs synth, curate, mixture, pretrain, sft)",
        "orca2: explanations, strategy_choice, orca_sft, orca_evaluate  (needs synth, curate, mixture, pretrain, sft)",
        "phi4: pts, dpo, workflows, midtrain, hallucination, judge_dpo  (needs synth, curate, mixture, pretrain, sft, verifier)",
        "phi4-ablations: mixture_ablations, synthetic_epochs  (needs synth, curate, mixture)  [on request: not in an all-stage run]",
        "tinygsm: verifier, evaluate, grid  (needs synth, curate, mixture, pretrain, sft)",
        "tinygsm-ablations: validated_sft  (needs synth, curate, mixture, pretrain, sft)  [on request: not in an all-stage run]",
    ]
    listed = json.loads(cli("recipes", "--json").stdout)
    assert listed["phi4"] == {"stages": ["pts", "dpo", "workflows", "midtrain", "hallucination", "judge_dpo"], "needs": ["synth", "curate", "mixture", "pretrain", "sft", "verifier"],
                              "on_request": False}
    assert listed["phi4-ablations"]["on_request"] is True
    assert listed["tinygsm-ablations"] == {"stages": ["validated_sft"], "needs": ["synth", "curate", "mixture", "pretrain", "sft"], "on_request": True}


def test_profiles(cli):
    result = cli("profiles")
    assert result.returncode == 0
    assert "smoke: " in result.stdout and "environment.sizes = [256, 512]" in result.stdout


def test_report_rerenders_a_run(cli, tmp_path):
    run_dir, reports = tmp_path / "myrun", tmp_path / "reports"
    assert cli("run", "--pipeline", PIPELINES / "basic", "--run-dir", run_dir, "--no-report").returncode == 0
    assert not reports.exists()
    result = cli("report", run_dir, "--report-dir", reports)
    assert result.returncode == 0, result
    index = reports / "myrun" / "index.html"
    assert f"report: {index}" in result.stdout
    page = index.read_text()
    assert "href='source.html'" in page and "href='double.html'" in page
    assert (reports / "myrun" / "double.html").is_file()

    missing = cli("report", tmp_path / "nothing", "--report-dir", reports)
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_bench_matmul_reports_ratio_to_numpy(cli):
    result = cli("bench", "matmul", "--json")
    assert result.returncode == 0, result
    data = json.loads(result.stdout)
    assert data["benchmark"] == "matmul" and data["baseline"] == "numpy float32 matmul"
    assert [r["n"] for r in data["rows"]] == [256, 512, 1024, 2048]
    for row in data["rows"]:
        assert row["torch_gflops"] > 0 and row["numpy_gflops"] > 0
        assert abs(row["torch_over_numpy"] - row["torch_gflops"] / row["numpy_gflops"]) < 0.01 * row["torch_over_numpy"] + 1e-3
    assert cli("bench", "nope").returncode == 2


def test_sampler_benchmark_arithmetic_on_known_timings(monkeypatch):
    "With the timer replaced by known timings, each shape's ratio, range, speeds and work ratio are what those timings give by hand."
    import slm_bench.bench.sampler as sampler
    from slm_bench.lm.models import flops_per_token, get_preset

    calls = []

    def fixed(runs, baseline, ours):
        baseline(), ours()  # both sides still run and check their completions' lengths
        calls.append(runs)
        return [2.0, 6.0, 3.0], [1.0, 2.0, 1.5]  # per repeat, baseline over ours: 2, 3, 2

    monkeypatch.setattr(sampler, "interleaved", fixed)
    monkeypatch.setattr(sampler, "matmul_peak", lambda: (100.0, "given"))
    result = sampler.bench_sampler(preset="llama-0.5m", shapes={"PTS": (2, 16, 4, 4), "plain": (2, 8, 1, 6)}, runs=3)
    assert calls == [3, 3, 3, 3]  # per shape: generate against ours, then ours with the eager step against the fused one
    assert [(r["shape"], r["ratio"], r["min–max"]) for r in result["rows"]] == [
        ("PTS: 4 samples per 16-token prompt, 4 new tokens, 2 prompts, content-seeded draws", 2.0, "2.0–3.0"),
        ("plain: 1 sample per 8-token prompt, 6 new tokens, 2 prompts", 2.0, "2.0–3.0")]
    pts, plain = result["details"]["PTS"], result["details"]["plain"]
    assert (pts["ours_new_tokens_per_s"], pts["baseline_new_tokens_per_s"]) == (round(32 / 1.5, 1), round(32 / 3.0, 1))  # 2×4×4 tokens
    assert (plain["ours_new_tokens_per_s"], plain["baseline_new_tokens_per_s"]) == (round(12 / 1.5, 1), round(12 / 3.0, 1))  # 2×1×6
    spec = get_preset("llama-0.5m", max_position_embeddings=20)
    prefill, decode = flops_per_token(spec, context=16)["forward"] * 16, flops_per_token(spec, context=18)["forward"] * 4
    # generate prefills each of the 2 prompts 4 times (once per sample); ours once; both decode 2×4 samples × 4 tokens
    assert pts["baseline_flops_over_ours"] == round((2 * 4 * prefill + 2 * 4 * decode) / (2 * prefill + 2 * 4 * decode), 2)
    assert plain["baseline_flops_over_ours"] == 1.0  # one sample per prompt: the same work on both sides
    assert pts["fused_over_eager_step"] == {"ratio": 2.0, "ratio_min": 2.0, "ratio_max": 3.0, "eager_new_tokens_per_s": round(32 / 3.0, 1),
                                                 "fused_new_tokens_per_s": round(32 / 1.5, 1)}
    assert result["rows"][0]["fused / eager step"] == "2.0 (2.0–3.0)"
    assert "prefills every prompt once per sample (4×)" in result["explanation"]
    assert result["ratio"] == "median of 3 interleaved repeats; min–max covers the median ratio with probability 75%"


def test_train_benchmark_arithmetic_and_verdict_on_known_timings(monkeypatch):
    "Engine over bare per repeat, from known timings: the median, the range, and the verdict the range implies."
    import slm_bench.bench.train as train

    timings = iter([([1.0, 1.0, 1.0], [1.25, 0.8, 1.0]), ([1.0, 1.0, 1.0], [1.25, 1.1, 1.2])])

    def fixed(runs, bare, engine):
        bare(), engine()  # both loops still run
        return next(timings)

    monkeypatch.setattr(train, "interleaved", fixed)
    monkeypatch.setattr(train, "matmul_peak", lambda: (100.0, "given"))
    small = dict(preset="llama-0.5m", seq_len=32, micro_batch=4, steps=2, runs=3)
    within = train.bench_train(**small)  # engine over bare: 0.8, 1.25, 1.0
    assert (within["ratio"], within["ratio_min"], within["ratio_max"]) == (1.0, 0.8, 1.25)
    assert within["verdict"] == "no measurable overhead: the ratio's range 0.8–1.25 includes 1"
    assert (within["engine_tokens_per_s"], within["bare_tokens_per_s"]) == (2 * 4 * 32 / 1.0, 2 * 4 * 32 / 1.0)
    slower = train.bench_train(**small)  # 0.8, 0.909, 0.833
    assert (slower["ratio"], slower["ratio_min"], slower["ratio_max"]) == (round(1 / 1.2, 3), 0.8, round(1 / 1.1, 3))
    assert slower["verdict"] == "the engine is slower than the bare loop: 17% overhead (median), range 0.8–0.909"
    assert slower["engine_tokens_per_s"] == round(256 / 1.2, 1)


def test_serve_bad_checkpoint_is_a_clear_error(cli, tmp_path):
    result = cli("serve", tmp_path / "missing", "--port", "0")
    assert result.returncode == 2 and "does not exist" in result.stderr and "Traceback" not in result.stderr
    (tmp_path / "notckpt").mkdir()
    result = cli("serve", tmp_path / "notckpt", "--port", "0")
    assert result.returncode == 2 and "no config.json" in result.stderr


def test_presets_report(cli):
    rows = {r["name"]: r for r in json.loads(cli("presets", "--json").stdout)}
    assert rows["llama2-7b"]["params_total"] == 6_738_415_616  # Llama 2 7B's published count
    assert rows["llama2-70b"]["attention"] == "GQA" and rows["phi4"]["rope_theta"] == 250_000
    assert rows["llama-2m"]["forward_flops_per_token"] == 2 * (8 * (4 * 128 * 128 + 3 * 128 * 344) + 2048 * 128) + 2 * 8 * 512 * 128
    assert "llama-8m" in cli("presets").stdout


def test_sandbox_benchmark_small():
    from slm_bench.bench.sandbox import bench_sandbox

    result = bench_sandbox(n=20, n_humaneval=5, repeats=1, workers=1)
    assert result["correct"] == {"pool": 25, "humaneval_style": 25, "fresh_python": 25}
    assert [row["family"] for row in result["rows"]] == ["math", "sympy", "plain", "humaneval"]
    assert result["isolation"][:2] == ["separate process", "fork per program"] and "seccomp" in result["isolation"]


def test_bench_pts_without_a_tiny_run_says_how_to_get_one(tmp_path):
    from slm_bench.core.errors import BadInput
    from slm_bench.bench.pts import bench_pts

    with pytest.raises(BadInput, match="make run"):
        bench_pts(run_dir=str(tmp_path))


def test_compare_two_runs_one_set_apart(cli, tmp_path):
    "An ablation: the same pipeline twice, one --set apart, compared in one table and written as HTML."
    for name, factor in (("factor2", 2), ("factor3", 3)):
        made = cli("run", "--pipeline", PIPELINES / "basic", "--run-dir", tmp_path / name, "--no-report", "--set", f"double.factor={factor}")
        assert made.returncode == 0, made
    result = cli("compare", tmp_path / "factor2", tmp_path / "factor3", "--report-dir", tmp_path / "reports")
    assert result.returncode == 0, result
    lines = result.stdout.splitlines()
    assert lines[0] == "### double/results"
    assert [line.split("|")[1].strip() for line in lines if line.startswith("| factor")] == [
        "factor2: doubled", "factor3: doubled", "factor2", "factor3"]  # the table's rows, then the metrics' rows
    assert "| factor3: doubled | 9 " in result.stdout  # 0 + 3 + 6
    page = tmp_path / "reports" / "compare" / "factor2__factor3.html"
    assert lines[-1] == f"compare: {page}"
    assert page.read_text().count("<table class='slm-bench'>") == 2


def _run_with_results(folder, rows):
    "A run folder as the runner leaves it: one stage whose table has `rows` (row: right answers of 100) and each row's paired difference to the first."
    from slm_bench.evals.metrics import accuracy_ci, paired_difference_ci
    from slm_bench.evals.table import BenchmarkTable

    answers = {row: [1] * right + [0] * (100 - right) for row, right in rows.items()}
    reference = next(iter(rows))
    table = BenchmarkTable("method")
    for row, correct in answers.items():
        table.add(row, "pass@1", accuracy_ci(correct))
        if row != reference:
            table.add_difference(row, reference, "pass@1", paired_difference_ci(correct, answers[reference]))
    table.save(folder / "evaluate" / "tables" / "results.json")
    (folder / "summary.json").write_text(json.dumps({"stages": [{"name": "evaluate", "metrics": {}}], "metrics": {}}))
    return folder


def test_compare_kept_says_which_results_a_faster_run_lost(cli, tmp_path):
    "compare --kept SLOWER FASTER: exit 0 when every result stayed; exit 1 and one line per result that left its interval or changed direction."
    slower = _run_with_results(tmp_path / "slower", {"SFT": 50, "DPO": 70})
    same = cli("compare", "--kept", slower, _run_with_results(tmp_path / "same", {"SFT": 52, "DPO": 68}))
    assert same.returncode == 0, same
    assert same.stdout.splitlines() == ["all 3 results kept: every value lies inside the slower run's interval and every paired difference keeps its direction"]
    moved = cli("compare", "--kept", slower, _run_with_results(tmp_path / "faster", {"SFT": 45, "DPO": 46}))
    assert moved.returncode == 1, moved
    assert moved.stdout.splitlines() == [
        "1 of 3 results kept; 2 not kept:",
        "  outside   evaluate/results: DPO / pass@1: slower 70.0 [60.0, 78.8] (n=100), faster 46.0 [36.0, 56.3] (n=100)",
        "  direction evaluate/results: DPO − SFT / pass@1: slower +20.0 [12.0, 28.0] (n=100), faster +1.0 [0.0, 3.0] (n=100)",
    ]
    three = cli("compare", "--kept", slower, tmp_path / "same", tmp_path / "faster")
    assert three.returncode == 2 and "--kept compares two runs, the slower then the faster; got 3 run folder(s)" in three.stderr


def test_findings_verdict_follows_the_data(cli, tmp_path):
    "The same stage code gives each verdict by the data alone: the basic pipeline's `double` records doubled − plain as a finding."
    counts = {verdict: 0 for verdict in ("reproduced", "contradicted", "inconclusive", "not_testable", "without_control")}
    for factor, verdict in ((2, "reproduced"), (1, "inconclusive"), (0, "contradicted")):
        run = tmp_path / f"factor{factor}"
        made = cli("run", "--pipeline", PIPELINES / "basic", "--run-dir", run, "--no-report", "--set", "source.n=40", "--set", f"double.factor={factor}")
        assert made.returncode == 0, made
        card = json.loads(cli("findings", run, "--json").stdout)
        assert card["counts"] == {"total": 1, **counts, verdict: 1, "tested": 1, "expected_false_reproduced": 0.03, "checks": 1}
        assert [c["id"] for c in card["ledger"]["checks"]] == ["phi4_numbers_read"]  # the check is listed apart, never counted as a finding
    text = cli("findings", tmp_path / "factor2").stdout.splitlines()
    assert text[0] == "Phi-4: 1 findings — 1 reproduced, 0 contradicted, 0 inconclusive, 0 not testable here, 0 without control; 1 checks"
    assert text[-1] == "  phi4_numbers_read: numbers read from source = 40 — source writes them"
    published = cli("findings", tmp_path / "factor2", "--publish", tmp_path / "results")
    assert published.returncode == 0 and published.stdout.strip() == f"published: {tmp_path / 'results' / 'scorecard.json'}"
    readme = tmp_path / "README.md"
    readme.write_text("# demo\n<!-- scorecard:start -->\n| typed | 99.9 |\n<!-- scorecard:end -->\n")
    args = ("--readme", readme, "--results", tmp_path / "results" / "scorecard.json")
    assert cli("readme", *args, "--check").returncode == 1  # a typed number differs from the published results
    assert cli("readme", *args).returncode == 0
    assert cli("readme", *args, "--check").returncode == 0
    assert "| reproduced | doubling raises every number (Table 0) | numbers × 2 − the numbers as they are | +19.5 [" in readme.read_text()
    assert cli("findings", tmp_path / "nowhere").returncode == 2


def test_stacks_sums_a_profiled_runs_time_into_parts(cli, tmp_path):
    "slm-bench stacks on py-spy's raw format: kernel samples per part at --rate, the sandbox workers apart; a missing file exits 2 and says what writes it."
    stacks = tmp_path / "stacks.txt"
    stacks.write_text(
        'process 7:"python -m ipykernel_launcher";_train_step (slm_bench/train/engine.py:330);backward (torch/autograd/__init__.py:270);'
        '_engine_run_backward (torch/autograd/graph.py:800) 6\n'
        'process 7:"python -m ipykernel_launcher";_generate_lean (slm_bench/infer/sampling.py:300);_step (slm_bench/infer/lean.py:180) 2\n'
        'process 9:"/usr/bin/bwrap --unshare-pid";worker_main (slm_bench/evals/sandbox_worker.py:300) 40\n')
    result = cli("stacks", stacks, "--rate", "2")
    assert result.returncode == 0, result
    assert result.stdout.splitlines()[1:3] == ["      3.0   75.0%  train: backward", "      1.0   25.0%  sample: lean decode step"]
    parsed = json.loads(cli("stacks", stacks, "--rate", "2", "--json").stdout)
    assert (parsed["seconds"], parsed["sandbox_worker_seconds"]) == (4.0, 20.0)
    missing = cli("stacks", tmp_path / "none.txt")
    assert missing.returncode == 2 and "make profile writes <run>/stacks.txt" in missing.stderr
