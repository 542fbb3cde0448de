"""The tiny world end to end with the `smoke` profile: every stage runs through the real runner and kernel."""
import importlib.util
import json

import pytest
import torch

from slm_bench.core.config import KEEP_FREED_MEMORY
from slm_bench.core.store import read_jsonl
from slm_bench.data.mixture import Source, epochs
from slm_bench.train.engine import CausalLM, resolve_precision

pytestmark = pytest.mark.slow  # the smoke profile's whole run, minutes: `make test-slow` (CI runs it)


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
        ("llama2", "chat_sft"), ("llama2", "preferences"), ("llama2", "reward_model"), ("llama2", "rejection_sampling"), ("llama2", "ppo"), ("llama2", "gatt"), ("llama2", "contamination"),
        ("llama2", "safety"), ("llama2", "rlhf_round2"),
        ("orca2", "explanations"), ("orca2", "strategy_choice"), ("orca2", "orca_sft"), ("orca2", "orca_evaluate"),
        ("phi4", "pts"), ("phi4", "dpo"), ("phi4", "workflows"), ("phi4", "midtrain"),
        ("phi4", "hallucination"), ("phi4-ablations", "mixture_ablations"), ("phi4-ablations", "synthetic_epochs"),
        ("tinygsm", "verifier"), ("phi4", "judge_dpo"), ("tinygsm", "evaluate"), ("tinygsm", "grid"), ("tinygsm-ablations", "validated_sft")]
    on_request = {"mixture_ablations", "synthetic_epochs", "validated_sft"}  # listed in the summary, left out of an all-stage run
    assert {s["name"]: (s["status"], s["action"]) for s in summary["stages"] if s["name"] in on_request} == {
        name: ("missing", "not selected") for name in on_request}
    assert summary["selected"] == [s["name"] for s in summary["stages"] if s["name"] not in on_request]
    assert all(s["status"] == "ok" for s in summary["stages"] if s["name"] not in on_request)
    # each stage's peak memory: at least its kernel with torch imported, and far below this machine's memory
    peaks = {s["name"]: s["peak_rss_bytes"] for s in summary["stages"] if s["name"] not in on_request}
    assert {name: 150 * 2**20 < peak < 16 * 2**30 for name, peak in peaks.items()} == {name: True for name in peaks}
    metrics = summary["metrics"]
    for key in ("pivots", "pairs", "rollouts_used"):
        assert key in metrics, key
    assert metrics["k"] == 4 and metrics["N"] == 4
    rates = ("pretrain_pass@1", "sft_pass@1", "sft_pass@k", "sft_maj@k", "sft_verify@N@1", "sft_sample_accuracy", "dpo_pass@1",
             "small_gen_small_ver", "small_gen_large_ver", "large_gen_small_ver", "large_gen_large_ver",
             "rm_helpful_accuracy", "rs2_pass@1", "unsafe_refusal_rate", "false_refusal_rate")  # rm_safety_accuracy: test_llama2_stages
    assert {key: 0 <= metrics[key] <= 1 for key in rates} == {key: True for key in rates}  # missing keys fail here too
    # relations that hold for any model: majority vote, verifier pick and a single sample are each right only where one of
    # the k = N = 4 samples is right, i.e. never more often than pass@4 (computed from those same 4 samples)
    assert metrics["sft_maj@k"] <= metrics["sft_pass@k"] and metrics["sft_verify@N@1"] <= metrics["sft_pass@k"]
    assert metrics["sft_sample_accuracy"] <= metrics["sft_pass@k"]
    assert metrics["sft_pass@1"] >= metrics["pretrain_pass@1"]  # strictly better only at the tiny profile (smoke: both 0); see below
    for key in ("sft_pass@1", "sft_verify@N@1"):
        low, high = metrics[f"{key}_ci"]
        assert low <= metrics[key] <= high, key
    assert metrics["sft_verify_minus_pass@1"] == pytest.approx(metrics["sft_verify@N@1"] - metrics["sft_pass@1"])
    # model FLOP utilization of the training stages: achieved GFLOP/s (tokens/s × 3 × forward FLOPs per token, by hand for
    # sft's llama shape at its 256-token rows) over the environment stage's measured peak
    sft_config = json.loads((run_dir / "sft" / "model" / "config.json").read_text())
    h, layers, ffn, vocab = (sft_config[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size"))
    forward = 2 * (layers * (4 * h * h + 3 * h * ffn) + vocab * h) + 2 * layers * 256 * h
    assert metrics["sft.train_gflops_per_s"] == pytest.approx(metrics["sft.tokens_per_s"] * 3 * forward / 1e9, rel=1e-3)
    # the peak is fp32's; bf16 autocast (AVX512-BF16: a bf16 dot product does twice an fp32 FMA's FLOPs per cycle) may pass it
    ceiling = 2 if resolve_precision("auto", CausalLM()) == "bf16" else 1
    for stage in ("pretrain", "sft"):
        assert metrics[f"{stage}.train_fraction_of_peak"] == round(metrics[f"{stage}.train_gflops_per_s"] / metrics["peak_gflops"], 4)
        assert 0 < metrics[f"{stage}.train_fraction_of_peak"] < ceiling, (stage, ceiling)
    index = (reports / "run" / "index.html").read_text()
    assert all(f"href='{name}.html'" in index for name in ("synth", "curate", "mixture", "pretrain", "sft", "verifier", "evaluate", "grid", "pts", "dpo"))
    assert index.count("<div class='about'>peak ") == len(peaks)
    for table in ("dpo/results", "evaluate/results", "grid/results"):  # the results tables: saved, in the index, printed at the end
        assert (run_dir / table.replace("/", "/tables/")).with_suffix(".json").is_file(), table
        assert f"<h2 class='results'>{table}</h2>" in index, table
        assert f"### {table}" in stdout, table
    grid = read(run_dir / "grid" / "grid.json")["grid"]
    assert {"small_gen_small_ver", "small_gen_large_ver", "large_gen_small_ver", "large_gen_large_ver"} <= set(grid)


def test_grid_pairs_differ_only_in_shape(smoke_run):
    "The grid's smaller pair is trained with the pretrain, sft and verifier stages' own settings; only its shape differs."
    from slm_bench.methods.tinygsm import PairRecipe

    run_dir, _, _ = smoke_run
    grid = read(run_dir / "grid" / "grid.json")
    params = {stage: read(run_dir / stage / "manifest.json")["parameters"] for stage in ("pretrain", "sft", "verifier")}
    for stage in ("pretrain", "sft", "verifier"):
        assert grid["recipe"][stage] == {k: params[stage][k] for k in PairRecipe.KEYS[stage]}, stage
    assert (grid["small_shape"]["hidden_size"], grid["small_shape"]["num_layers"]) == (32, 2)
    assert (params["pretrain"]["hidden_size"], params["pretrain"]["num_layers"]) == (128, 5)
    assert grid["small_shape"]["vocab_size"] == read(run_dir / "mixture" / "metrics.json")["vocab_size"]
    assert grid["small_params"] < grid["large_params"]
    assert grid["small_labelled"] == 24 * 2 * 2  # the same questions x samples x checkpoints as the pipeline's verifier
    assert (run_dir / "grid" / "small" / "sft" / "checkpoints" / "step-000015" / "model" / "config.json").is_file()
    results = read(run_dir / "evaluate" / "results.json")  # the GSM-IC-style column beside the plain test set
    assert results["sft on test_ic"]["problems"] == results["sft"]["problems"] == 24


def test_synth_and_curate(smoke_run):
    run_dir, _, _ = smoke_run
    train = [json.loads(line) for line in (run_dir / "synth" / "train.jsonl").read_text().splitlines()]
    test = [json.loads(line) for line in (run_dir / "synth" / "test.jsonl").read_text().splitlines()]
    dev = [json.loads(line) for line in (run_dir / "synth" / "dev.jsonl").read_text().splitlines()]
    test_ic = [json.loads(line) for line in (run_dir / "synth" / "test_ic.jsonl").read_text().splitlines()]
    assert len(train) == 1500 and len(test) == 40 and len(dev) == 24 and len(test_ic) == 40
    from slm_bench.data.synth import TRAIN_VOCAB

    train_names = {name for name, _ in TRAIN_VOCAB.names}
    words = lambda r: set(r["question"].replace(".", " ").replace(",", " ").replace("'s", " ").split())
    assert [r["question"] for r in test + dev if words(r) & train_names] == []  # held-out names: none the training set uses
    assert {r["question"].split()[0] for r in train} & train_names  # (the check can fire: training questions do name them)
    assert not {r["question"] for r in test} & {r["question"] for r in dev}
    assert not any(r["irrelevant"] for r in test + dev) and all(r["irrelevant"] for r in test_ic)
    curate = read(run_dir / "curate" / "metrics.json")
    assert curate["kept"] < curate["generated"] == 1500
    assert curate["validate_answers"] is False  # TinyGSM: planted errors stay in
    assert curate["wrong_answers_found"] == sum(r["corrupted"] for r in train)  # ... and are counted
    report = read(run_dir / "curate" / "contamination.json")
    assert set(report["report"]) == {"tinygsm13", "tinygsm8", "phi4"}
    assert sorted(report["eval_sets"]) == ["gsm8k test", "svamp test", "tiny-world dev", "tiny-world test", "tiny-world test (IC)",
                                           "tiny-world test (new templates)"]
    new_templates = read_jsonl(run_dir / "synth" / "test_new_templates.jsonl")
    assert len(new_templates) == 24 and not {r["question"] for r in new_templates} & {r["question"] for r in test}
    checks = {c["id"]: c["value"] for c in read(run_dir / "curate" / "findings.json")["checks"]}  # the split, as the ledger records it
    assert (checks["template_overlap_test"], checks["template_overlap_test_new_templates"]) == (1.0, 0.0)


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


def test_sft_beats_pretrain_on_held_out_solutions(smoke_run):
    """SFT > pretrain where the smoke profile can show it. At this size neither model solves a held-out problem (both
    greedy pass@1 are 0), but SFT must have learnt the task's format: the reference programs of the held-out test problems
    are more likely under SFT than under the pretrained model (answer-only loss, the SFT objective)."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slm_bench.methods.tinygsm import sft_examples

    run_dir, _, _ = smoke_run
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "mixture" / "tokenizer")
    test = [json.loads(line) for line in (run_dir / "synth" / "test.jsonl").read_text().splitlines()]
    examples = sft_examples(tokenizer, test)

    def held_out_loss(stage: str) -> float:
        model = AutoModelForCausalLM.from_pretrained(run_dir / stage / "model").eval()
        total, tokens = 0.0, 0
        with torch.no_grad():
            for example in examples:
                ids, labels = torch.tensor([example["input_ids"]]), torch.tensor(example["labels"][1:])
                logits = model(input_ids=ids).logits[0, :-1]
                total += F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum").item()
                tokens += int((labels != -100).sum())
        return total / tokens

    pretrain, sft = held_out_loss("pretrain"), held_out_loss("sft")
    assert len(examples) == 40 and sft < pretrain, (sft, pretrain)


def test_pts_and_dpo_stages(smoke_run):
    "PTS screened its questions and accounted for every one; DPO chose β on dev, trained on whatever pairs it found and compared with SFT."
    run_dir, _, _ = smoke_run
    pts = read(run_dir / "pts" / "metrics.json")
    assert pts["questions_screened"] == 24
    assert pts["skipped_all_wrong"] + pts["skipped_all_right"] + pts["skipped_out_of_range"] + pts["questions_searched"] == 24
    assert pts["rollouts_used"] >= 24 * 8 and pts["pairs"] + pts["pivots_without_pair"] == pts["pivots"]
    assert pts["pivots_without_pair"] == pts["pivots_not_confirmed"] + pts["pivots_without_alternative"]
    pairs = [json.loads(line) for line in (run_dir / "pts" / "pairs.jsonl").read_text().splitlines()]
    trl = [json.loads(line) for line in (run_dir / "pts" / "pairs_trl.jsonl").read_text().splitlines()]
    assert len(pairs) == len(trl) == pts["pairs"]
    for pair, text in zip(pairs, trl):
        assert pair["p_chosen"] > pair["p_prefix"] > pair["p_rejected"] and len(pair["chosen_ids"]) == len(pair["rejected_ids"]) == 1
        assert text["chosen"] == pair["chosen_text"] and text["prompt"] == pair["prompt_text"]
    assert (run_dir / "cache" / "pts_memo.jsonl").is_file() and (run_dir / "cache" / "pts_fresh_memo.jsonl").is_file()
    dpo = read(run_dir / "dpo" / "metrics.json")
    results = read(run_dir / "dpo" / "results.json")
    assert dpo["dpo_test_problems"] == 12 and set(results) == {"SFT", "DPO (PTS pairs)", "DPO (control pairs)", "DPO - control", "DPO - SFT", "control - SFT"}
    assert (dpo["dpo_beta"] is None) == (pts["pairs"] == 0)  # β is chosen on dev only when there is something to train on
    assert dpo["dpo_minus_sft"] == pytest.approx(dpo["dpo_pass@1"] - dpo["dpo_baseline_sft_pass@1"], abs=1e-3)
    summary = read(run_dir / "summary.json")["metrics"]  # evaluate's keys keep their plain names next to the new stages
    assert "sft_pass@1" in summary and "dpo_pass@1" in summary and "pts.pairs" not in summary


def test_bench_pts_runs_on_a_run_folder(smoke_run):
    """The benchmark on the smoke run's model: every method searches the same solutions, each is scored against the reference
    (cached), and the baseline's N sweep stops at the first N matching each of ours on precision and recall."""
    from slm_bench.bench.pts import bench_pts

    run_dir, _, _ = smoke_run
    result = bench_pts(str(run_dir), questions=6, discovery_rollouts=8, baseline_ns=(8, 16), repeats=1, sequential=True, first_question=0)
    methods, ours = result["methods"], ["ours", "ours_discovery_8"]
    assert result["same_solutions_searched"]
    assert all(len(m["seconds"]) == 1 for m in methods.values())
    assert result["reference"]["solutions"] == methods["ours"]["solutions_searched"]
    assert (run_dir / "cache" / "pts_reference_memo.jsonl").is_file()
    at_least = lambda name, target: all((methods[name][k]["value"] or 0) >= (methods[target][k]["value"] or 0) for k in ("precision", "recall"))
    first_match = {t: next((n for n in ("codelion_style_N8", "codelion_style_N16") if at_least(n, t)), None) for t in ours}
    assert {t: (q["baseline"], q["reached"]) for t, q in result["equal_quality"].items()} == {
        t: (m or "codelion_style_N16", m is not None) for t, m in first_match.items()}
    swept = ["codelion_style_N8"] + (["codelion_style_N16"] if first_match["ours"] != "codelion_style_N8"
                                     or first_match["ours_discovery_8"] != "codelion_style_N8" else [])
    assert list(methods) == ours + swept
    assert result["ratio"] == result["equal_quality"]["ours_discovery_8"]["ratio"]
    again = bench_pts(str(run_dir), questions=6, discovery_rollouts=8, baseline_ns=(8, 16), repeats=1, sequential=True, first_question=0)
    assert again["reference"]["rollouts_sampled_now"] == 0  # the reference came from the memo


# Wall-clock measurements, not results: the only metrics, and the files holding them, allowed to differ between two runs
TIMING_METRICS = {"teacher_problems_per_s", "curation_samples_per_s", "tokens_per_s", "train_gflops_per_s", "pts_seconds"}
TIMING_FILES = {"metrics.json", "train/metrics.jsonl"}  # metrics.json is compared above, without its timings
REPRODUCED_STAGES = ("synth", "curate", "mixture", "pretrain", "sft")


def test_the_same_command_gives_the_same_numbers(smoke_run, tmp_path):
    """Reproducibility on one machine: metrics identical to the last bit (timings aside) and byte-identical models.

    Rerunning the whole smoke pipeline would double this module's time, so two parts: the data and training stages
    (synth, curate, mixture, pretrain, sft) run again from nothing in a fresh folder; and `evaluate` (sampling, the
    sandbox, the verifier's scores) reruns with --force in a copy of the smoke run, on the same inputs."""
    import shutil
    import subprocess

    from conftest import ROOT, SLM_BENCH

    run_dir, _, _ = smoke_run

    def run(*args):
        proc = subprocess.run([str(SLM_BENCH), "run", "--profile", "smoke", "--no-report", *map(str, args)], cwd=ROOT,
                              capture_output=True, text=True, timeout=1500)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    def results(folder, stage):
        metrics = read(folder / stage / "metrics.json")
        return {k: v for k, v in metrics.items() if k not in TIMING_METRICS}

    def files(folder, stage):
        "Every output file's hash (the manifest's list), except the files that hold timings."
        return {k: v for k, v in read(folder / stage / "manifest.json")["outputs"].items() if k not in TIMING_FILES}

    again = tmp_path / "again"
    run("--stages", ",".join(REPRODUCED_STAGES), "--run-dir", again)
    for stage in REPRODUCED_STAGES:
        assert results(again, stage) == results(run_dir, stage), stage
        # the data, the tokenizer, the packed rows, the weights, the figures: byte for byte (with a random string-hash
        # seed per kernel, curate's contamination.json named other test items on ties: the runner now fixes the seed)
        assert files(again, stage) == files(run_dir, stage), stage
    assert "model/model.safetensors" in files(again, "sft") and "contamination.json" in files(again, "curate")

    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    run("--stages", "evaluate", "--force", "--run-dir", copy)
    assert read(copy / "evaluate" / "manifest.json")["started"] != read(run_dir / "evaluate" / "manifest.json")["started"]  # it ran again
    assert results(copy, "evaluate") == results(run_dir, "evaluate")
    assert files(copy, "evaluate") == files(run_dir, "evaluate") and "results.json" in files(copy, "evaluate")
    determined = read(again / "pretrain" / "manifest.json")["determined_by"]  # what the manifest says decided the numbers
    assert determined["seeds"] == {"seed": 0} and determined["torch_threads"] == torch.get_num_threads()
    assert determined["cpu"]["flags"] and determined["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert determined["training_precision"] == resolve_precision("auto", CausalLM())  # bf16 autocast where the CPU has AVX512-BF16


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here: gpu_check.sh runs the stages on it")
def test_stages_sample_on_the_backend_the_run_chose(smoke_run, tmp_path):
    """`--set sample.backend=vllm` reaches each stage's kernel, and a stage's sampler comes from `infer.backend.open_sampler`:
    with vLLM not installed here, pts (whose first cell opens its sampler) refuses with the fix, exit 2, and the setting is in
    its manifest and key. This goes through the runner's API, as a Slurm job on a node without vLLM would; `slm-bench run`
    refuses before any stage starts (test_bad_input)."""
    import shutil

    from conftest import ROOT

    from slm_bench.core.errors import StageRefusedInput
    from slm_bench.pipeline.runner import RunOptions, plan_run, run_pipeline

    run_dir, _, _ = smoke_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    plan = plan_run(RunOptions(pipeline_dir=ROOT / "nbs" / "stages", run_dir=copy, profile="smoke", stages=["pts"],
                               sets=["sample.backend=vllm"]))
    with pytest.raises(StageRefusedInput) as failure:
        run_pipeline(plan, log=lambda line: None)
    assert "sample.backend=vllm, but vLLM is not installed in" in str(failure.value)
    manifest = read(copy / "pts" / "manifest.json")
    assert (manifest["status"], manifest["engine"]["sample.backend"]) == ("failed", "vllm")
    assert manifest["cache_key"] != read(run_dir / "pts" / "manifest.json")["cache_key"]


def test_training_stages_train_sharded_with_train_strategy_fsdp(smoke_run, tmp_path):
    """`--set train.strategy=fsdp --set train.processes=2`: pretrain and sft train under `accelerate launch` with FSDP
    (two CPU processes over gloo here, GPUs on a node), and the rest of each notebook goes on with the trained weights.
    Their micro-batch stays 8 rows per process and grad_accum 1 does not divide by 2, so each step takes twice the rows."""
    import shutil
    import subprocess

    import yaml

    from conftest import ROOT, SLM_BENCH

    run_dir, _, _ = smoke_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    proc = subprocess.run([str(SLM_BENCH), "run", "--profile", "smoke", "--no-report", "--run-dir", str(copy), "--stages", "pretrain,sft",
                           "--set", "train.strategy=fsdp", "--set", "train.processes=2"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for stage in ("pretrain", "sft"):
        manifest = read(copy / stage / "manifest.json")
        assert manifest["engine"] == {"train.strategy": "fsdp", "train.processes": 2, "sample.backend": "hf", "sample.gpu_memory": 0.5,
                                      "cpu.mkl_cbwr": "AUTO,STRICT", "cpu.glibc_tunables": KEEP_FREED_MEMORY}, stage
        assert manifest["cache_key"] != read(run_dir / stage / "manifest.json")["cache_key"], stage  # the setting is in the key
        launch = yaml.safe_load((copy / stage / "train" / "launch" / "accelerate.yaml").read_text())
        assert (launch["distributed_type"], launch["num_processes"], launch["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"]) == \
            ("FSDP", 2, "LlamaDecoderLayer"), stage
        result = read(copy / stage / "train" / "launch" / "result.json")
        assert result["processes"] == 2 and not (copy / stage / "train" / "launch" / "bundle.pt").exists(), stage
        sharded = [json.loads(line) for line in (copy / stage / "train" / "metrics.jsonl").read_text().splitlines()]
        single = [json.loads(line) for line in (run_dir / stage / "train" / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in sharded] == [m["step"] for m in single], stage
        assert all(a["tokens"] == 2 * b["tokens"] for a, b in zip(sharded, single)), stage
        assert sharded[-1]["loss"] < sharded[0]["loss"], stage
        assert (copy / stage / "model" / "model.safetensors").is_file(), stage
        # the two training processes under accelerate launch count in the stage's peak memory (each imports torch)
        assert manifest["peak_rss_bytes"] > read(run_dir / stage / "manifest.json")["peak_rss_bytes"] + 200 * 2**20, stage


def test_llama2_stages(smoke_run):
    "Preferences in TRL's format that pass the boundary check, two reward models with scalar heads, two RS checkpoints, the figures."
    from slm_bench.methods.preferences import RATINGS, TRACKS, validate_preferences
    from slm_bench.train.reward import RewardModel

    run_dir, _, _ = smoke_run
    rows = [json.loads(line) for line in (run_dir / "preferences" / "preferences.jsonl").read_text().splitlines()]
    assert validate_preferences(rows) == rows and rows
    assert {r["track"] for r in rows} == set(TRACKS)
    assert all({"prompt", "chosen", "rejected", "margin"} <= set(r) and r["rating"] in RATINGS for r in rows)
    assert {r["split"] for r in rows} == {"train", "test"}
    # the open pairs: planted-error twins, the right program chosen over the wrong one, all training data
    open_rows = [json.loads(line) for line in (run_dir / "preferences" / "open_preferences.jsonl").read_text().splitlines()]
    assert len(open_rows) == 60 and validate_preferences(open_rows) == open_rows
    assert {(r["source"], r["track"], r["split"], r["rating"]) for r in open_rows} == {("open", "helpfulness", "train", "significantly better")}
    assert {(r["chosen_facts"]["correct"], r["rejected_facts"]["correct"]) for r in open_rows} == {(True, False)}
    assert read(run_dir / "reward_model" / "metrics.json")["rm_open_pairs"] == 60
    for name in ("helpful_rm", "safety_rm"):
        assert type(RewardModel.from_pretrained(run_dir / "reward_model" / name)).__name__ == "RewardModel"
    # accuracy on significantly-better helpfulness pairs: a rate when the test split has such pairs, None (no estimate) when not
    significant = [r for r in rows if (r["split"], r["track"], r["rating"]) == ("test", "helpfulness", "significantly better")]
    accuracy = read(run_dir / "reward_model" / "metrics.json")["rm_helpful_accuracy_significantly_better"]
    assert (accuracy is None) if not significant else (0 <= accuracy <= 1), (len(significant), accuracy)
    # the safety RM's accuracy likewise: None when the test split holds no safety pair the paper keeps ("both unsafe" pairs are
    # kept; only an unsafe chosen response against a safe one is excluded)
    from slm_bench.methods.llama2 import paper_excluded

    usable = [r for r in rows if (r["split"], r["track"]) == ("test", "safety") and not paper_excluded(r)]
    accuracy = read(run_dir / "reward_model" / "metrics.json")["rm_safety_accuracy"]
    assert (accuracy is None) if not usable else (0 <= accuracy <= 1), (len(usable), accuracy)
    for name in ("rs1", "rs2"):
        assert (run_dir / "rejection_sampling" / name / "config.json").is_file(), name
    metrics = read(run_dir / "rejection_sampling" / "metrics.json")
    assert {"rs_max_minus_median_k1", "rs_max_minus_median_k4"} <= set(metrics)
    assert metrics["rs_max_minus_median_k1"] == 0.0  # one sample: its max is its median
    tables = {p.stem for p in (run_dir / "reward_model" / "tables").glob("*.json")}
    assert tables == {"table8", "table28"}
    for figure in ("reward_model/scores.png", "rejection_sampling/figure7.png", "rejection_sampling/figure8.png", "preferences/ratings.png"):
        assert (run_dir / figure).stat().st_size > 1000, figure


def test_llama2_ppo_stage(smoke_run):
    "Three PPO runs from RS-2 (the paper's, β = 0, the oracle's reward), a metrics line per iteration, the KL zero at the start, the figures."
    run_dir, _, _ = smoke_run
    metrics = read(run_dir / "ppo" / "metrics.json")
    assert {"ppo_reward_gain", "ppo_kl", "ppo_pass@1", "ppo_exec_pass@1", "ppo_no_kl_hacking"} <= set(metrics)
    assert 0 <= metrics["ppo_pass@1"] <= 1 and 0 <= metrics["ppo_kept_iteration"] <= 3
    assert (run_dir / "ppo" / "policy" / "config.json").is_file()
    for run in ("ppo", "no_kl", "execution"):
        rows = [json.loads(line) for line in (run_dir / "ppo" / f"train_{run}" / "metrics.jsonl").read_text().splitlines()]
        assert [r["iteration"] for r in rows] == [1, 2, 3], run  # smoke: 3 iterations
        assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-3), run  # the first batch comes from π0 itself
        assert {"rc", "oracle", "helpful_pass", "clip_fraction", "entropy"} <= set(rows[0]), run
    results = read(run_dir / "ppo" / "results.json")
    assert set(results["histories"]) == {"PPO", "PPO, β = 0", "PPO, execution reward"}
    for figure in ("ppo/iterations.png", "ppo/reward_vs_kl.png"):
        assert (run_dir / figure).stat().st_size > 1000, figure


def test_llama2_rlhf_round2(smoke_run):
    "Round 2 retrains both RMs, samples from round 1's policy, pools with round 1's best samples, runs PPO; each round set against the one before."
    run_dir, _, _ = smoke_run
    for name in ("helpful_rm", "safety_rm", "rs", "policy"):
        assert (run_dir / "rlhf_round2" / name / "config.json").is_file(), name
    round1 = read(run_dir / "rejection_sampling" / "best_samples.json")
    ledger = read(run_dir / "rlhf_round2" / "findings.json")
    controls = {f["id"]: (f["experiment"], f["control"]) for f in ledger["findings"]}
    assert controls["llama2_round1_helpfulness"] == ("round 1 (RS, then PPO)", "SFT (chat), the start")
    assert controls["llama2_round2_helpfulness"] == ("round 2 (RS, then PPO)", "round 1, the start")
    assert controls["llama2_round2_safety"] == ("round 2 (RS, then PPO)", "round 1, the start")
    checks = {c["id"]: c["value"] for c in ledger["checks"]}
    assert checks["llama2_round2_pairs"] == len((run_dir / "rlhf_round2" / "preferences.jsonl").read_text().splitlines())
    means = {float(t): m for t, m in read(run_dir / "rlhf_round2" / "results.json")["temperature"]["choose_means"].items()}
    assert checks["llama2_round2_temperature"] == max(sorted(means), key=lambda t: (means[t], -t))  # the re-tuning rule, on its own record
    # pooling: the pool keeps every prompt of iterations 1 and 2 and adds iteration 3's; a prompt's entry is its best so far
    pooled = read(run_dir / "rlhf_round2" / "best_samples.json")
    assert set(round1) < set(pooled)
    assert all(pooled[pid]["reward"] >= entry["reward"] for pid, entry in round1.items())
    assert {e["iteration"] for e in pooled.values()} - {1, 2} == {3}


def test_llama2_gatt_stage(smoke_run):
    "Models with and without GAtt, adherence at every turn for both, the attention grid (turns × layers), the figures."
    run_dir, _, _ = smoke_run
    metrics = read(run_dir / "gatt" / "metrics.json")
    assert {"gatt_adherence_turn4", "nogatt_adherence_turn4", "gatt_adherence_turn1", "gatt_examples"} <= set(metrics)  # smoke: 4 turns
    assert all(0 <= metrics[k] <= 1 for k in ("gatt_adherence_turn4", "nogatt_adherence_turn4"))
    for name in ("with_gatt", "without_gatt"):
        assert read(run_dir / "gatt" / name / "config.json")["max_position_embeddings"] == 512, name
    results = read(run_dir / "gatt" / "results.json")
    assert {name: len(curve) for name, curve in results["adherence"].items()} == {"without GAtt": 4, "with GAtt": 4}
    layers = read(run_dir / "gatt" / "with_gatt" / "config.json")["num_hidden_layers"]
    assert {name: (len(grid), len(grid[0])) for name, grid in results["attention"].items()} == {"without GAtt": (3, layers), "with GAtt": (3, layers)}
    for figure in ("gatt/adherence.png", "gatt/attention.png"):
        assert (run_dir / figure).stat().st_size > 1000, figure


def test_llama2_contamination_stage(smoke_run):
    "Planted copies of test problems found dirty at every L, the verdicts for both models, the real benchmarks beside TinyGSM's and Phi-4's rules."
    run_dir, _, _ = smoke_run
    metrics = read(run_dir / "contamination" / "metrics.json")
    assert metrics["contamination_planted_recall_L10"] == 1.0  # verbatim copies: every token inside a long match
    assert 0 <= metrics["contamination_false_dirty_L10"] <= 18  # smoke: 24 problems, 6 planted
    assert {"contamination_planted_detected", "contamination_planted_affects", "contamination_gsm8k_dirty", "contamination_svamp_dirty"} <= set(metrics)
    results = read(run_dir / "contamination" / "results.json")
    assert len(results["planted"]) == 6 and set(results["percents"]) == {"10", "20"}
    assert all(results["percents"]["10"][i] == 100.0 for i in results["planted"])
    assert set(results["verdicts"]) == {f"{name}, L = {L}" for name in ("SFT + planted", "SFT + replay", "gain (planted − replay)") for L in (10, 20)}
    assert {k: v["samples"] for k, v in results["real"].items()} == {"gsm8k": 1319, "svamp": 1000}
    assert {p.stem for p in (run_dir / "contamination" / "tables").glob("*.json")} == {"planted", "real"}
    assert (run_dir / "contamination" / "contamination.png").stat().st_size > 1000


def test_llama2_safety_stage(smoke_run):
    "Context distillation from PPO and from chat SFT, gated by the safety RM; the two ablations; before/after rates; the figures."
    run_dir, _, _ = smoke_run
    metrics = read(run_dir / "safety" / "metrics.json")
    rates = ("safety_unsafe_rate_before", "safety_unsafe_rate_after", "false_refusal_rate_before", "false_refusal_rate_after",
             "chat_sft_cd_unsafe_rate_before", "chat_sft_cd_unsafe_rate_after", "ungated_unsafe_rate", "table40_false_refusal_rate")
    assert {key: 0 <= metrics[key] <= 1 for key in rates} == {key: True for key in rates}
    results = read(run_dir / "safety" / "results.json")
    assert {name: len(rows) for name, rows in results["distilled"].items()} == {"PPO": 12, "SFT (chat)": 12}  # smoke: 12 attacked requests
    for rows in results["distilled"].values():  # the gate: kept exactly where the preprompted answer scores higher
        assert [r["kept"] for r in rows] == [r["distilled_score"] > r["original_score"] for r in rows]
    assert metrics["safety_cd_kept"] == sum(r["kept"] for r in results["distilled"]["PPO"])
    assert set(results["reports"]) == {"SFT (chat)", "PPO", "PPO + safety CD", "SFT (chat) + safety CD", "PPO + CD, ungated",
                                       "PPO + CD on helpful prompts", "PPO + replay only", "SFT (chat) + replay only"}  # each CD model's control
    assert {name: set(rates) for name, rates in results["by_vector"].items()} == {v: set(results["reports"]) for v in
                                                                                  ("authority", "role_play", "false_premise", "misspelling")}
    assert (run_dir / "safety" / "policy" / "config.json").is_file()
    for figure in ("safety/scores.png", "safety/gate.png"):
        assert (run_dir / figure).stat().st_size > 1000, figure


@pytest.mark.parametrize("stage, spoil, expected", [
    ("reward_model", "rating", "preferences.jsonl, row 1: unknown rating 'great'"),
    ("reward_model", "identical", "preferences.jsonl, row 1: chosen and rejected are the same response"),
    ("rejection_sampling", "head", "is not a reward model checkpoint: it has no scalar head (verifier_head.pt)"),
    ("rejection_sampling", "k", "rejection sampling needs K >= 1 samples per prompt, got 0"),
    ("ppo", "ablations", "unknown PPO ablation(s) ['judge']: choose from no_kl, execution"),
    ("safety", "starts", "safety.starts must name checkpoints among ppo, rejection_sampling, chat_sft, got ['base']"),
    ("explanations", 'set:explanations.strategies=["tree_of_thought"]', "explanations.strategies: unknown strategy 'tree_of_thought'; the library has: direct"),
    ("explanations", 'set:explanations.strategies=["guess"]', "task family 'add' has no teacher answers"),
    ("strategy_choice", "set:strategy_choice.dev_problems=2", "have no dev problems, so no strategy can be chosen for them: raise strategy_choice.dev_problems"),
    ("orca_sft", 'set:orca_sft.students=["teacher"]', "orca_sft.students must name students among direct, program, erasure, erasure_empty, progressive, mixed, explanation_tuning"),
])
def test_stages_refuse_bad_input_with_exit_2_and_write_no_output(smoke_run, tmp_path, stage, spoil, expected):
    """Bad preference rows, a reward checkpoint without its scalar head, K < 1, an unknown strategy, a family no strategy fits,
    a family without dev problems: exit 2, the message names the problem, no output is written."""
    import shutil
    import subprocess

    from conftest import ROOT, SLM_BENCH

    run_dir, _, _ = smoke_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    extra = []
    if spoil in ("rating", "identical"):
        path = copy / "preferences" / "preferences.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        rows[0] = {**rows[0], "rating": "great"} if spoil == "rating" else {**rows[0], "rejected_ids": rows[0]["chosen_ids"]}
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif spoil == "head":
        (copy / "reward_model" / "helpful_rm" / "verifier_head.pt").unlink()
    elif spoil == "ablations":
        extra = ["--set", 'ppo.ablations=["judge"]']
    elif spoil == "starts":
        extra = ["--set", 'safety.starts=["base"]']
    elif spoil.startswith("set:"):
        extra = ["--set", spoil.removeprefix("set:")]
    else:
        extra = ["--set", "rejection_sampling.k=0"]
    shutil.rmtree(copy / stage)
    proc = subprocess.run([str(SLM_BENCH), "run", "--profile", "smoke", "--no-report", "--run-dir", str(copy), "--stages", stage, *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert expected in proc.stderr, proc.stderr[-2000:]
    assert read(copy / stage / "manifest.json")["status"] == "failed"
    outputs = {"reward_model": ["helpful_rm", "safety_rm", "results.json"], "rejection_sampling": ["rs1", "rs2", "results.json"],
               "ppo": ["policy", "results.json"], "safety": ["policy", "results.json"], "explanations": ["strong.jsonl", "weak.jsonl"],
               "strategy_choice": ["model", "choice.json"], "orca_sft": ["students", "data.json"]}[stage]
    assert [o for o in outputs if (copy / stage / o).exists()] == []


def test_orca2_stages(smoke_run):
    "Teacher data in every strategy, the choice per family, the students (progressive resuming), both evaluation conditions, the judge."
    from transformers import AutoModelForCausalLM

    from slm_bench.methods.orca import weights_fingerprint
    from slm_bench.methods.orca_strategies import STRATEGIES

    run_dir, _, _ = smoke_run
    strong = [json.loads(line) for line in (run_dir / "explanations" / "strong.jsonl").read_text().splitlines()]
    assert {r["family"] for r in strong} == {"add", "divide", "chain"}  # the smoke profile's families
    assert {r["strategy"] for r in strong} == set(STRATEGIES)
    assert read(run_dir / "explanations" / "metrics.json")["dropped"] == 0
    choice = read(run_dir / "strategy_choice" / "choice.json")
    assert set(choice) == {"add", "divide", "chain", "_rule", "_cost_tokens"}
    assert all(c["strategy"] == c["ranking"][0] and set(c["ranking"]) <= set(STRATEGIES) for f, c in choice.items() if not f.startswith("_"))
    data = read(run_dir / "orca_sft" / "data.json")
    assert set(data) == {"direct", "program", "erasure", "erasure_empty", "explanation_tuning", "progressive", "mixed"}
    assert {name: s["steps"] for name, s in data.items()} == dict.fromkeys(data, 4)  # the same budget for every student
    for name in ("progressive", "mixed"):  # the same rows in two phases of the same steps: only the order differs
        weak_phase, strong_phase = data[name]["phases"]
        assert (weak_phase["steps"], strong_phase["steps"]) == (2, 2), name
        assert strong_phase["start"] == weights_fingerprint(AutoModelForCausalLM.from_pretrained(weak_phase["checkpoint"])), name
    answers = [json.loads(line) for line in (run_dir / "orca_evaluate" / "answers.jsonl").read_text().splitlines()]
    counts = {}
    for a in answers:
        counts[(a["student"], a["condition"], a["set"])] = counts.get((a["student"], a["condition"], a["set"]), 0) + 1
    sizes = {"tiny": 12, "gsm8k": 3, "svamp": 3}
    students = ["direct", "program", "erasure", "erasure_empty", "progressive", "mixed"]
    expected = {(n, c, s): sizes[s] for n in students for c in ("empty", "cautious") for s in sizes}
    expected |= {("explanation_tuning", "instruction", s): sizes[s] for s in sizes} | {("explanation_tuning", "chosen", "tiny"): 12}
    assert counts == expected  # each student asked under the system message it was trained with (explanation tuning: its instructions)
    summary = read(run_dir / "summary.json")["metrics"]
    names = ("orca_erasure_pass@1", "orca_direct_pass@1", "orca_stepwise_pass@1", "orca_explanation_tuning_pass@1", "orca_progressive_pass@1",
             "orca_mixed_pass@1", "orca_format_ok")
    assert {k: 0 <= summary[k] <= 1 for k in names} == dict.fromkeys(names, True)
    erasure_tiny = [a["correct"] for a in answers if (a["student"], a["set"]) == ("erasure", "tiny")]
    assert summary["orca_cautious_minus_empty"] == pytest.approx((sum(erasure_tiny[12:]) - sum(erasure_tiny[:12])) / 12, abs=1e-4)
    metrics = read(run_dir / "orca_evaluate" / "metrics.json")
    assert (metrics["judge_kind"], metrics["judge_model"], metrics["judge_version"]) == ("rule-based", "tiny-world rule judge", "1")
    assert metrics["judge_position_consistent"] == 1.0 and metrics["judge_length_grade_gain"] == 0.0
    for figure in ("explanations/lengths.png", "strategy_choice/heatmap.png", "orca_sft/loss.png", "orca_evaluate/families.png"):
        assert (run_dir / figure).stat().st_size > 1000, figure


def test_phi4_workflows_stage(smoke_run):
    "Every workflow wrote its source; the counts add up; the sources' unique tokens are those of their documents."
    from fractions import Fraction

    from slm_bench.evals.tasks import numbers_equal

    run_dir, _, _ = smoke_run
    folder = run_dir / "workflows"
    metrics = read(folder / "metrics.json")
    rows = lambda name: [json.loads(line) for line in (folder / name).read_text().splitlines()]
    assert metrics["roles"] == "embedded"
    assert metrics["seed_passages_kept"] == len(rows("seeds.jsonl")) and all(r["score"] >= 0.5 for r in rows("seeds.jsonl"))
    assert metrics["plurality_kept"] == len(rows("plurality.jsonl"))
    assert metrics["plurality_kept"] + metrics["plurality_unanimous"] + metrics["plurality_no_consensus"] <= 16  # smoke: 16 questions
    assert metrics["plurality_min_share"] in (0.0, 0.375, 0.5, 0.625, 0.75)
    assert metrics["rewrites"] == len(rows("rewrites.jsonl")) == 6 * 3  # smoke: 6 seeds, 2 variants and 1 harder version each
    revisions = rows("revisions.jsonl")
    assert len(revisions) == 8 and all(len(r["drafts"]) == len(r["scores"]) <= 3 for r in revisions)  # smoke: 2 rounds
    assert metrics["self_revision_improved"] == sum(r["scores"][-1] > r["scores"][0] for r in revisions) / 8
    reversal = rows("reversal.jsonl")
    assert len(reversal) == 16 and metrics["reversal_kept"] == sum(r["kept"] for r in reversal) / 16
    same = lambda a, b: "None" not in (a, b) and numbers_equal(Fraction(a), Fraction(b))
    assert all(r["kept"] == same(r["original_value"], r["regenerated_value"]) for r in reversal)
    sources = read(folder / "sources.json")
    assert sources["rewrites"]["documents"] == 18 and sources["curated seeds"]["documents"] == metrics["seed_passages_kept"]
    assert all((c["documents"] == 0) == (c["unique_tokens"] == 0) for c in sources.values())


def test_phi4_midtrain_stage(smoke_run):
    "Five models measured at each length; the extended ones carry the raised RoPE base, the control the original one; the metrics are the table's."
    from transformers import AutoConfig

    run_dir, _, _ = smoke_run
    folder = run_dir / "midtrain"
    metrics, recall = read(folder / "metrics.json"), read(folder / "recall.json")
    assert set(recall["recall"]) == {"base", "RoPE base raised, not trained", "midtrained, natural", "midtrained, concatenated",
                                     "midtrained, natural, original RoPE base"}
    assert all(set(by_length) == {"64", "256"} for by_length in recall["recall"].values())  # smoke: lengths 64 and 256 (4 x 64)
    assert metrics["long_context"] == 256 and metrics["rope_theta"] == 250000.0
    assert metrics["midtrain_recall_4x"] == round(recall["recall"]["midtrained, natural"]["256"], 4)
    assert metrics["base_recall_4x"] == round(recall["recall"]["base"]["256"], 4)
    assert set(recall["short_pass@1"]) == {"base", "midtrained, natural", "midtrained, concatenated"}
    for name in ("natural", "concatenated"):
        config = AutoConfig.from_pretrained(folder / f"train_{name}" / "final")
        assert config.rope_parameters["rope_theta"] == 250000.0, name
    assert AutoConfig.from_pretrained(folder / "train_base" / "final").rope_parameters["rope_theta"] == 10000.0
    assert AutoConfig.from_pretrained(folder / "train_natural_original_base" / "final").rope_parameters["rope_theta"] == 10000.0
    assert metrics["original_base_recall_4x"] == round(recall["recall"]["midtrained, natural, original RoPE base"]["256"], 4)


def test_phi4_hallucination_stage(smoke_run):
    "The data follow Phi-4's rules; the outcome shares of each checkpoint add up to one; the metrics are the outcomes'."
    run_dir, _, _ = smoke_run
    folder = run_dir / "hallucination"
    metrics, results = read(folder / "metrics.json"), read(folder / "outcomes.json")
    sft = [json.loads(line) for line in (folder / "sft_data.jsonl").read_text().splitlines()]
    pairs = [json.loads(line) for line in (folder / "dpo_pairs.jsonl").read_text().splitlines()]
    assert sum(r["kind"] == "bogus: refusal" for r in sft) == metrics["halluc_bogus_kept"]  # each checked bogus problem refused
    assert metrics["halluc_bogus_kept"] + metrics["halluc_bogus_rejected"] <= 8  # smoke: 8 candidates, those still answerable rejected
    assert all(r["body"].rstrip().endswith("return result") and "result = None" in r["body"] for r in sft if "refusal" in r["kind"])
    assert len(pairs) == metrics["halluc_dpo_pairs"] and all(len(p["chosen_ids"]) <= 5 and len(p["rejected_ids"]) <= 5 for p in pairs)
    assert list(results)[:4] == ["SFT", "SFT + refusal data", "+ DPO (hallucination and PTS pairs)", "SFT + replay only (control)"]
    for name, r in results.items():
        for part in ("answerable", "bogus", "all"):
            shares = r[part]
            assert shares["correct"] + shares["incorrect"] + shares["not_attempted"] == pytest.approx(1.0), (name, part)
        assert r["bogus"]["correct"] == 0.0  # nothing is right on a problem with a quantity missing
    assert metrics["halluc_not_attempted_after"] == round(results["+ DPO (hallucination and PTS pairs)"]["bogus"]["not_attempted"], 4)
    assert metrics["halluc_answerable_pass@1_before"] == round(results["SFT"]["answerable"]["correct"], 4)



def test_phi4_judge_dpo_stage(smoke_run):
    "Every response scored by the verifier judge; the pairs are exactly what the labelling rule makes of the recorded scores; the audit is the scores against execution, and its gate decides whether round 2 trained."
    from slm_bench.core.store import read_jsonl
    from slm_bench.methods.judge_dpo import judge_audit, judge_gate, judged_pairs

    run_dir, _, _ = smoke_run
    folder = run_dir / "judge_dpo"
    metrics, audit = read(folder / "metrics.json"), read(folder / "audit.json")
    responses, pairs = read_jsonl(folder / "responses.jsonl"), read_jsonl(folder / "pairs.jsonl")
    assert len(responses) == 8 * (3 * 2 + 1)  # smoke: 8 prompts, three checkpoints with two samples each, and the teacher
    assert {r["model"] for r in responses} == {"SFT", "DPO round 1", "SFT step 15", "teacher"}
    groups = [[r for r in responses if r["prompt_index"] == i] for i in range(8)]
    assert [{k: v for k, v in p.items() if k != "oracle_agrees"} for p in pairs] == judged_pairs(groups, 1.0, "all")
    assert len(pairs) == metrics["judge_dpo_pairs"] > 0
    # the verifier judge's accuracy is 1 + 9 p(correct): any value in [1, 10], not the rule grades
    assert audit["judge"]["kind"] == "trained model" and all(1.0 <= r["scores"]["accuracy"] <= 10.0 for r in responses)
    recomputed = judge_audit([r["scores"] for r in responses], [r["correct"] for r in responses])
    assert audit["agreement"]["accuracy"] == pytest.approx(recomputed["agreement"]["accuracy"])
    assert metrics["judge_oracle_agreement"] == round(recomputed["agreement"]["accuracy"], 4)
    assert audit["position_bias"]["consistent"] == 1.0  # pointwise: by construction
    params = read(folder / "manifest.json")["parameters"]
    gate = judge_gate(audit, params["min_agreement"], params["agreement_bound"], params["beat_constant"])
    assert audit["gate"] == gate and metrics["judge_passed_audit"] == gate["passed"]
    findings = {f["id"]: f for f in read(folder / "findings.json")["findings"]}
    assert gate["passed"] is True  # smoke: min_agreement 0 and no constant-judge bar, so round 2 trains (the closed gate: test_judge_gate)
    results = read(folder / "results.json")["results"]
    assert metrics["dpo2_pass@1"] == round(results["final (stage 1 + stage 2)"]["accuracy"], 4)
    assert (folder / "model" / "config.json").is_file()
    assert findings["phi4_judge_round2_over_round1"]["control"] and not findings["phi4_judge_round2_over_round1"]["not_testable"]


def test_phi4_ablations_recipe_runs_on_request_beside_a_finished_run(smoke_run):
    "Not part of the all-stage run; asked for, it reuses the run's data stages; its deltas are the recorded scores' and its epochs the planned ones."
    import subprocess

    from conftest import ROOT, SLM_BENCH
    from slm_bench.methods.mixture_ablation import mixture_deltas

    run_dir, _, _ = smoke_run
    assert not (run_dir / "mixture_ablations").exists() and not (run_dir / "synthetic_epochs").exists()
    proc = subprocess.run([str(SLM_BENCH), "run", "--profile", "smoke", "--run-dir", str(run_dir), "--recipe", "phi4-ablations", "--no-report", "--jobs", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [line.split()[1] for line in proc.stdout.splitlines() if " cached" in line] == ["synth", "curate", "mixture"]
    ablations = read(run_dir / "mixture_ablations" / "ablations.json")
    assert list(ablations["mixtures"]) == ["reference", "Uniform", "S", "S + WR", "S + W", "web-heavy (phi-3-medium stand-in)"]
    for name, shares in ablations["mixtures"].items():
        assert shares["code"] == 0.25 and sum(shares.values()) == pytest.approx(1.0), name
    recomputed = mixture_deltas({n: ablations["scores"][n] for n in ["reference", "Uniform", "S", "S + WR", "S + W"]}, "reference")
    assert recomputed == ablations["table4"]
    metrics = read(run_dir / "mixture_ablations" / "metrics.json")
    assert metrics["s_minus_ref_knowledge"] == round(ablations["table4"]["S"]["knowledge"]["difference"], 4)
    epochs = read(run_dir / "synthetic_epochs" / "epochs.json")
    assert list(epochs["scores"]) == ["phase 1", "4 epochs", "12 epochs"]
    for e in ("4", "12"):  # the draw stops at whole documents: within one document of the plan
        assert epochs["realised"][e]["synthetic_epochs"] == pytest.approx(int(e), abs=1.0)
        assert epochs["realised"][e]["web_epochs"] <= 1.0  # the web documents are fresh: none repeats
    difference = sum(epochs["scores"]["12 epochs"]["reasoning"]) - sum(epochs["scores"]["4 epochs"]["reasoning"])
    assert epochs["difference"]["reasoning"]["difference"] == pytest.approx(difference / len(epochs["scores"]["4 epochs"]["reasoning"]))
