"""`slm-bench plan`: every profile validated against the stages without a GPU, and estimates checked by hand for two models."""
import json
import subprocess

import pytest

from conftest import ROOT, SLM_BENCH
from slm_bench.core.config import PROFILES
from slm_bench.pipeline.stages import discover_stages

STAGES = discover_stages(ROOT / "nbs" / "stages")


@pytest.mark.parametrize("profile", list(PROFILES))
def test_every_profile_key_is_a_typed_parameter_of_a_stage(profile):
    "The runner skips profile keys of stages outside a pipeline, so a misspelt stage would pass silently: it may not here."
    for key, value in PROFILES[profile].values.items():
        stage, name = key.split(".", 1)
        assert stage in STAGES, f"profile {profile}: {key}: no stage {stage!r}"
        assert name in STAGES[stage].params, f"profile {profile}: {key}: {stage} has no parameter {name!r}"
        STAGES[stage].params[name].check(value, f"profile {profile}, {key}")  # raises BadInput on a wrong type


def plan(*args):
    proc = subprocess.run([str(SLM_BENCH), "plan", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    return proc


def test_the_gpu_profile_plans_without_a_gpu_and_the_estimates_match_a_hand_calculation(tmp_path):
    proc = plan("--profile", "gpu", "--peak-tflops", "100", "--run-dir", tmp_path / "run", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert [e["stage"] for e in result["stages"]] == [name for name, s in STAGES.items() if not s.on_request]
    assert (result["peak_tflops"], result["peak_source"], result["activations"]) == (100.0, "given (--peak-tflops)", "bf16 (the profile runs on CUDA)")
    sft = next(e for e in result["stages"] if e["stage"] == "sft")
    # the run's model: llama-2m with pretrain's overrides h=128, 5 layers, FFN 340, and the mixture's 1,024-token vocabulary
    attention, mlp, norms, embeddings = 4 * 128 * 128 * 5, 3 * 128 * 340 * 5, 2 * 128 * 5 + 128, 1024 * 128
    n = attention + mlp + norms + 2 * embeddings
    assert sft["params"] == n == 1_244_032
    tokens = 650 * 24 * 256  # sft: steps × micro-batch × row length
    assert sft["memory_bytes"] == {"weights": 4 * n, "gradients": 4 * n, "optimizer": 8 * n,
                                   "activations": 34 * 24 * 256 * 128 * 5 + 8 * 24 * 256 * 1024, "reference": 0, "kv_cache": 0,
                                   "engine": 0}
    train_flops = tokens * 3 * (2 * (attention + mlp + embeddings) + 2 * 5 * 256 * 128)
    assert sft["flops"]["train_flops"] == train_flops
    assert sft["seconds"] == pytest.approx(train_flops / (100e12 * 0.4))


def test_llama2_7b_does_not_fit_an_80gb_gpu_and_plan_says_which_stages(tmp_path):
    proc = plan("--profile", "gpu", "--model", "llama2-7b", "--peak-tflops", "989", "--gpu-mem", "80", "--recipe", "tinygsm",
                "--run-dir", tmp_path / "run", "--json")
    assert proc.returncode == 2, proc.stderr
    n = 6_738_415_616  # Llama 2 7B: 32 layers, h 4096, FFN 11008, vocab 32000, untied head
    pretrain_activations = 34 * 16 * 384 * 4096 * 32 + 8 * 16 * 384 * 32000  # pretrain: 16 rows of the mixture's 384 tokens, bf16
    gib = lambda b: f"{b / 2**30:.1f} GiB"
    assert proc.stderr.splitlines()[:2] == [
        "slm-bench plan: error: 3 stage(s) will not fit one GPU (--gpu-mem) (80 GiB):",
        f"  pretrain: about {gib(16 * n + pretrain_activations)} (weights {gib(4 * n)}, gradients {gib(4 * n)}, "
        f"optimizer {gib(8 * n)}, activations {gib(pretrain_activations)})"]
    assert [line.split(":")[0].strip() for line in proc.stderr.splitlines()[1:4]] == ["pretrain", "sft", "verifier"]
    # the estimates came first, with the sampling stages' KV cache: evaluate decodes 128 sequences of 96 + 160 tokens in bf16
    evaluate = next(e for e in json.loads(proc.stdout)["stages"] if e["stage"] == "evaluate")
    assert evaluate["memory_bytes"]["kv_cache"] == 2 * 32 * 32 * 128 * 2 * 128 * (96 + 160)
    assert evaluate["memory_bytes"]["gradients"] == evaluate["memory_bytes"]["optimizer"] == 0


def test_plan_on_a_pipeline_without_a_model_asks_for_one(tmp_path):
    failing = ROOT / "tests" / "pipelines" / "failing"
    proc = plan("--pipeline", failing, "--profile", "smoke", "--run-dir", tmp_path / "run", "--peak-tflops", "1")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (f"slm-bench plan: error: the pipeline {failing} has no pretrain stage to take the model from; "
                           "pass --model PRESET (slm-bench presets)\n")
    proc = plan("--pipeline", failing, "--profile", "smoke", "--run-dir", tmp_path / "run", "--peak-tflops", "1", "--model", "llama-2m")
    assert proc.returncode == 0 and proc.stdout.splitlines()[-3:-1] == [
        "ok                  no workload described for this stage (pipeline.estimate.WORKLOADS)",
        "boom                no workload described for this stage (pipeline.estimate.WORKLOADS)"]


def test_sampling_on_vllm_counts_its_engine_and_refuses_a_share_that_cannot_hold_the_model(tmp_path):
    """`--set sample.backend=vllm` with --gpu-mem: a sampling stage holds its model (fp32, 4·N) beside an engine of
    sample.gpu_memory × the GPU; FSDP over 4 GPUs lets Llama 2 7B train, and the engine's share decides the rest."""
    n, gib = 6_738_415_616, 2**30
    common = ("--profile", "gpu", "--model", "llama2-7b", "--peak-tflops", "989", "--gpu-mem", "80", "--recipe", "tinygsm",
              "--gpus-per-stage", "4", "--set", "train.strategy=fsdp", "--set", "sample.backend=vllm", "--run-dir", tmp_path / "run")
    proc = plan(*common, "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["sampling"] == "vllm: an engine of 0.5 × 80 GiB beside the stage's model (the KV cache column)"
    evaluate = next(e for e in result["stages"] if e["stage"] == "evaluate")
    assert evaluate["memory_bytes"] == {"weights": 4 * n, "gradients": 0, "optimizer": 0, "activations": 0, "reference": 0,
                                        "kv_cache": 0, "engine": 40 * gib}
    proc = plan(*common, "--set", "sample.gpu_memory=0.8")  # 64 GiB of engine + 25.1 GiB of model > 80 GiB
    assert proc.returncode == 2
    over = f"about {(4 * n + 64 * gib) / gib:.1f} GiB (weights {4 * n / gib:.1f} GiB, engine 64.0 GiB)"
    assert proc.stderr.splitlines() == ["slm-bench plan: error: 3 stage(s) will not fit one GPU (--gpu-mem) (80 GiB):",
                                        f"  verifier: {over}", f"  evaluate: {over}", f"  grid: {over}",
                                        "  lower the vLLM engine's share of the GPU (--set sample.gpu_memory), sample with "
                                        "--set sample.backend=hf, or give the jobs a larger GPU"]
    proc = plan(*common, "--set", "sample.gpu_memory=0.1")  # 8 GiB cannot hold 12.6 GiB of bf16 weights
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == ("slm-bench plan: error: a vLLM engine gets 8.0 GiB (sample.gpu_memory 0.1 of --gpu-mem 80 GiB), but "
                           "llama2-7b's bf16 weights alone take 12.6 GiB: raise --set sample.gpu_memory, or sample with --set sample.backend=hf\n")
