"""`slm-bench replicate --seeds 2` on the smoke profile, every recipe: the data stages computed once, every trained stage
with its replicate's training seed, and the pooled findings what the crossed bootstrap gives."""
import json
import subprocess

import pytest

from slm_bench.evals.seeds import crossed_bootstrap_ci

pytestmark = pytest.mark.slow  # two smoke runs, minutes: `make test-slow` (CI runs it)

SHARED = ["environment", "synth", "curate", "mixture", "explanations"]


def read(path):
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    from conftest import ROOT, SLM_BENCH

    root = tmp_path_factory.mktemp("smoke") / "smoke-replicate"
    proc = subprocess.run([str(SLM_BENCH), "replicate", "--seeds", "2", "--profile", "smoke", "--root", str(root), "--no-report", "--jobs", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root


def test_the_shared_stages_ran_once_and_every_other_stage_ran_in_each_replicate(replicated):
    first, second = (read(replicated / f"replicate-{r}" / "summary.json") for r in (0, 1))
    assert (first["replicate"], second["replicate"]) == (0, 1)
    selected = [s["name"] for s in second["stages"] if s["action"] != "not selected"]
    assert {s["name"]: s["action"] for s in second["stages"] if s["name"] in selected} == {
        name: "cached" if name in SHARED else "ran" for name in selected}
    assert {s["name"] for s in second["stages"] if s["shared_by_replicates"]} == set(SHARED)
    for name in SHARED:
        link = replicated / "replicate-1" / name
        assert link.is_symlink() and link.resolve() == (replicated / "replicate-0" / name).resolve()
    for name in ("pretrain", "sft", "dpo", "ppo", "orca_sft"):
        runtimes = [read(replicated / f"replicate-{r}" / name / "manifest.json")["determined_by"] for r in (0, 1)]
        assert [d["replicate"] for d in runtimes] == [0, 1] and [d["seeds"]["seed"] for d in runtimes] == [0, 0]


def test_different_seeds_give_different_weights_on_the_same_data(replicated):
    for name in ("pretrain", "sft", "verifier"):
        weights = [(replicated / f"replicate-{r}" / name / "model" / "model.safetensors").read_bytes() for r in (0, 1)]
        assert weights[0] != weights[1], name
    losses = [read(replicated / f"replicate-{r}" / "pretrain" / "metrics.json")["final_loss"] for r in (0, 1)]
    assert losses[0] != losses[1]
    # the evaluation items are the data's: every finding scored on items scored the same number in both replicates
    ledgers = [read(replicated / f"replicate-{r}" / "evaluate" / "findings.json")["findings"] for r in (0, 1)]
    lengths = [[len(f["differences"]) for f in ledger if f.get("differences")] for ledger in ledgers]
    assert lengths[0] and lengths[0] == lengths[1]


def test_the_pooled_interval_is_the_crossed_bootstrap_over_both_replicates(cli, replicated):
    pooled = cli("findings", replicated, "--json")
    assert pooled.returncode == 0, pooled
    card = json.loads(pooled.stdout)
    finding = next(f for f in card["ledger"]["findings"] if f["id"] == "tinygsm_sft_lifts_generator")
    rows = [next(f for f in read(replicated / f"replicate-{r}" / "evaluate" / "findings.json")["findings"]
                 if f["id"] == "tinygsm_sft_lifts_generator")["differences"] for r in (0, 1)]
    assert (finding["effect"]["ci_low"], finding["effect"]["ci_high"]) == crossed_bootstrap_ci(rows)
    assert finding["effect"]["seeds"] == 2 and len(finding["seeds"]) == 2
    held = card["held_in_seeds"]["TinyGSM"]
    tested = sum(card["papers"]["TinyGSM"][v] for v in ("reproduced", "contradicted", "inconclusive"))
    assert held["all"] + held["some"] + held["none"] == tested and held["seeds"] == 2
