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
        "phi4: pts, dpo  (needs synth, curate, mixture, pretrain, sft)",
        "tinygsm: verifier, evaluate, grid  (needs synth, curate, mixture, pretrain, sft)",
    ]
    listed = json.loads(cli("recipes", "--json").stdout)
    assert listed["phi4"] == {"stages": ["pts", "dpo"], "needs": ["synth", "curate", "mixture", "pretrain", "sft"]}


def test_profiles(cli):
    result = cli("profiles")
    assert result.returncode == 0
    assert "smoke: " in result.stdout and "environment.sizes = [64, 128]" in result.stdout


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


def test_sampler_and_train_benchmarks_report_ratios():
    from slm_bench.bench.sampler import bench_sampler
    from slm_bench.bench.train import bench_train

    s = bench_sampler(preset="llama-0.5m", prompts=2, prompt_len=16, samples=2, new_tokens=4, runs=1)
    assert s["ratio"] == round(s["ours_new_tokens_per_s"] / s["baseline_new_tokens_per_s"], 3) or abs(
        s["ratio"] - s["ours_new_tokens_per_s"] / s["baseline_new_tokens_per_s"]) < 0.01
    assert 0 < s["fraction_of_peak"] and s["peak_gflops"] > 0 and s["workload"]["samples"] == 2
    t = bench_train(preset="llama-0.5m", seq_len=32, micro_batch=4, steps=2, runs=1)
    assert abs(t["ratio"] - t["engine_tokens_per_s"] / t["bare_tokens_per_s"]) < 0.01 and t["fraction_of_peak"] > 0


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
