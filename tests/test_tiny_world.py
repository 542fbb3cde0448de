"""The tiny world end to end with the `smoke` profile: every stage runs through the real runner and kernel."""
import json

import pytest
import torch

from slm_bench.data.mixture import Source, epochs


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    import subprocess

    from conftest import ROOT, SLM_BENCH

    base = tmp_path_factory.mktemp("tiny-world")
    run_dir, reports = base / "run", base / "reports"
    proc = subprocess.run([str(SLM_BENCH), "run", "--profile", "smoke", "--run-dir", str(run_dir), "--report-dir", str(reports)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir, reports, proc.stdout


def read(path):
    return json.loads(path.read_text())


def test_every_stage_ran_and_the_summary_has_the_figures(smoke_run):
    run_dir, reports, stdout = smoke_run
    summary = read(run_dir / "summary.json")
    assert [(s["recipe"], s["name"]) for s in summary["stages"]] == [
        ("common", "environment"), ("common", "synth"), ("common", "curate"), ("common", "mixture"), ("common", "pretrain"), ("common", "sft"),
        ("phi4", "pts"), ("phi4", "dpo"), ("tinygsm", "verifier"), ("tinygsm", "evaluate"), ("tinygsm", "grid")]
    assert all(s["status"] == "ok" for s in summary["stages"])
    metrics = summary["metrics"]
    for key in ("pretrain_pass@1", "sft_pass@1", "sft_maj@k", "sft_verify@N@1", "k", "N", "dpo_pass@1", "pivots", "pairs", "rollouts_used"):
        assert key in metrics, key
    assert metrics["k"] == 4 and metrics["N"] == 4
    index = (reports / "run" / "index.html").read_text()
    assert all(f"href='{name}.html'" in index for name in ("synth", "curate", "mixture", "pretrain", "sft", "verifier", "evaluate", "grid", "pts", "dpo"))
    for table in ("dpo/results", "evaluate/results", "grid/results"):  # the results tables: saved, in the index, printed at the end
        assert (run_dir / table.replace("/", "/tables/")).with_suffix(".json").is_file(), table
        assert f"<h2 class='results'>{table}</h2>" in index, table
        assert f"### {table}" in stdout, table
    grid = read(run_dir / "grid" / "grid.json")["grid"]
    assert {"small_gen_small_ver", "small_gen_large_ver", "large_gen_small_ver", "large_gen_large_ver"} <= set(grid)


def test_synth_and_curate(smoke_run):
    run_dir, _, _ = smoke_run
    train = [json.loads(line) for line in (run_dir / "synth" / "train.jsonl").read_text().splitlines()]
    test = [json.loads(line) for line in (run_dir / "synth" / "test.jsonl").read_text().splitlines()]
    assert len(train) == 1500 and len(test) == 40
    train_names = {r["question"].split()[0] for r in train}
    assert not any(r["question"].split()[0] in train_names for r in test)  # held-out names
    curate = read(run_dir / "curate" / "metrics.json")
    assert curate["kept"] < curate["generated"] == 1500
    assert curate["removed_filters"] >= sum(r["corrupted"] for r in train) * 0.8  # planted errors are caught by answer validation
    report = read(run_dir / "curate" / "contamination.json")
    assert set(report["report"]) == {"tinygsm13", "tinygsm8", "phi4"}
    assert sorted(report["eval_sets"]) == ["gsm8k test", "svamp test", "tiny-world test"]  # the real sets ship with the package


def test_mixture_epochs_follow_the_formula(smoke_run):
    run_dir, _, _ = smoke_run
    mixture = read(run_dir / "mixture" / "mixture.json")
    sources = [Source(name, s["share"], s["unique_tokens"]) for name, s in mixture["sources"].items()]
    expected = epochs(sources, mixture["budget_tokens"])
    for name, s in mixture["sources"].items():
        assert s["planned_epochs"] == pytest.approx(expected[name])
        assert abs(s["realised_share"] - s["share"]) < 0.05  # the sampler honours the shares
    rows = torch.load(run_dir / "mixture" / "pretrain_rows.pt")
    assert rows["input_ids"].shape[1] == mixture["seq_len"]


def test_training_stages_learn_and_save(smoke_run):
    from transformers import AutoModelForCausalLM

    run_dir, _, _ = smoke_run
    for stage in ("pretrain", "sft"):
        losses = [json.loads(line)["loss"] for line in (run_dir / stage / "train" / "metrics.jsonl").read_text().splitlines()]
        assert losses[-1] < losses[0], (stage, losses[0], losses[-1])
        AutoModelForCausalLM.from_pretrained(run_dir / stage / "model")
    assert (run_dir / "sft" / "train" / "checkpoints" / "step-000015" / "model" / "config.json").is_file()  # named checkpoint kept
    verifier = read(run_dir / "verifier" / "metrics.json")
    assert verifier["labelled"] == 24 * 2 * 2  # questions x samples x checkpoints (final + step 15)
    results = read(run_dir / "evaluate" / "results.json")
    assert {"pretrain", "sft"} <= set(results) and "verify@4@1" in results["sft"]
    sft = results["sft"]  # the paired difference is exactly verify@N@1 − greedy pass@1, on the same problems
    assert sft["verify_minus_greedy"]["difference"] == pytest.approx(sft["verify@4@1"]["accuracy"] - sft["pass@1"]["accuracy"])
    assert sft["verify_minus_greedy"]["ci_low"] <= sft["verify_minus_greedy"]["difference"] <= sft["verify_minus_greedy"]["ci_high"]
    assert 0 <= sft["verifier_on_mixed"]["problems"] <= sft["problems"]


def test_pts_and_dpo_stages(smoke_run):
    "PTS screened its questions and accounted for every one; DPO trained on whatever pairs it found and compared with SFT."
    run_dir, _, _ = smoke_run
    pts = read(run_dir / "pts" / "metrics.json")
    assert pts["questions_screened"] == 24
    assert pts["skipped_all_wrong"] + pts["skipped_all_right"] + pts["skipped_out_of_range"] + pts["questions_searched"] <= 24
    assert pts["rollouts_used"] >= 24 * 8 and pts["pairs"] + pts["pivots_without_pair"] == pts["pivots"]
    pairs = [json.loads(line) for line in (run_dir / "pts" / "pairs.jsonl").read_text().splitlines()]
    trl = [json.loads(line) for line in (run_dir / "pts" / "pairs_trl.jsonl").read_text().splitlines()]
    assert len(pairs) == len(trl) == pts["pairs"]
    for pair, text in zip(pairs, trl):
        assert pair["p_chosen"] - pair["p_rejected"] >= 0.2 and len(pair["chosen_ids"]) == len(pair["rejected_ids"]) == 1
        assert text["chosen"] == pair["chosen_text"] and text["prompt"] == pair["prompt_text"]
    assert (run_dir / "cache" / "pts_memo.jsonl").is_file()
    dpo = read(run_dir / "dpo" / "metrics.json")
    results = read(run_dir / "dpo" / "results.json")
    assert dpo["dpo_test_problems"] == 12 and set(results) == {"SFT", "DPO (PTS pairs)", "DPO - SFT"}
    assert dpo["dpo_minus_sft"] == pytest.approx(dpo["dpo_pass@1"] - dpo["dpo_baseline_sft_pass@1"], abs=1e-3)
    summary = read(run_dir / "summary.json")["metrics"]  # evaluate's keys keep their plain names next to the new stages
    assert "sft_pass@1" in summary and "dpo_pass@1" in summary and "pts.pairs" not in summary


def test_bench_pts_runs_on_a_run_folder(smoke_run):
    "The benchmark's three methods on the smoke run's model: the open implementation's approach finds the same pivots as ours."
    from slm_bench.bench.pts import bench_pts

    run_dir, _, _ = smoke_run
    result = bench_pts(str(run_dir), questions=6, rollouts=8, adaptive_rollouts=16, first_question=0)
    assert result["same_solutions_searched"] and result["same_pivots_as_open_implementation"]
    assert result["ours_pivots_found_by_brute_force"] == result["pivots"]["ours"]
    assert result["rollouts_screening"] == 6 * 8 and result["ratio"] > 0
