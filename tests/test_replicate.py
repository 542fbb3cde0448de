"""`slm-bench replicate` end to end on a two-stage pipeline: shared data computed once, training seeds that differ, a killed
replicate that resumes, and the pooled finding equal to the crossed bootstrap over the replicates' per-item differences."""
import json
import os
import signal
import subprocess

from conftest import PIPELINES, SLM_BENCH
from slm_bench.evals.seeds import crossed_bootstrap_ci
from slm_bench.pipeline.context import replicate_seed
from test_runner import _pid_alive, _wait_for

REPLICATED = PIPELINES / "replicated"


def read(path):
    return json.loads(path.read_text())


def test_replicates_share_the_data_vary_the_training_seed_and_pool(cli, tmp_path):
    root, gate = tmp_path / "rep", tmp_path / "gate"
    gate.write_text("hold")
    args = [str(SLM_BENCH), "replicate", "--seeds", "2", "--pipeline", str(REPLICATED), "--root", str(root), "--no-report",
            "--set", f"train.gate={gate}"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:  # replicate 0 passes the gate only once it is lifted; kill the command while replicate 0's training waits
        _wait_for(lambda: (root / "replicate-0" / "train" / "kernel.pid").exists(), what="replicate 0's train stage to start")
        kernel_pid = int((root / "replicate-0" / "train" / "kernel.pid").read_text())
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _wait_for(lambda: not _pid_alive(kernel_pid), timeout=30, what="the orphaned kernel to exit")
    assert read(root / "replicate-0" / "world" / "manifest.json")["status"] == "ok"
    assert not (root / "replicate-0" / "train" / "manifest.json").exists()

    gate.unlink()
    resumed = cli("replicate", "--seeds", "2", "--pipeline", REPLICATED, "--root", root, "--no-report", "--set", f"train.gate={gate}")
    assert resumed.returncode == 0, resumed
    assert "world  cached" in resumed.stdout  # replicate 0's data survived the kill
    assert "== replicate 1 of 2" in resumed.stdout and "shared from replicate 0: world" in resumed.stdout

    first, second = root / "replicate-0", root / "replicate-1"
    # the shared stage ran once: replicate 1's folder is a link to replicate 0's, and its run took it as cached
    assert (second / "world").is_symlink() and (second / "world").resolve() == (first / "world").resolve()
    assert {s["name"]: s["action"] for s in read(second / "summary.json")["stages"]} == {"world": "cached", "train": "ran"}
    assert read(first / "world" / "manifest.json")["determined_by"]["replicate"] == 0
    # the trained stage: the data seed kept, the training seed and the weights changed
    m0, m1 = read(first / "train" / "metrics.json"), read(second / "train" / "metrics.json")
    assert (m0["train_seed"], m1["train_seed"]) == (0, replicate_seed(0, 1)) and (m0["replicate"], m1["replicate"]) == (0, 1)
    assert read(first / "train" / "weights.json") != read(second / "train" / "weights.json")
    assert read(second / "train" / "manifest.json")["determined_by"]["replicate"] == 1
    assert read(root / "replicate.json")["members"] == ["replicate-0", "replicate-1"]

    # the pooled finding is the crossed bootstrap over both replicates' per-item differences, on the same 60 items
    rows = [read(member / "train" / "findings.json")["findings"][0]["differences"] for member in (first, second)]
    assert [len(r) for r in rows] == [60, 60]
    pooled = cli("findings", root, "--json")
    assert pooled.returncode == 0, pooled
    finding = json.loads(pooled.stdout)["ledger"]["findings"][0]
    low, high = crossed_bootstrap_ci(rows)
    assert (finding["effect"]["ci_low"], finding["effect"]["ci_high"], finding["effect"]["seeds"]) == (low, high, 2)
    assert finding["effect"]["difference"] == sum(map(sum, rows)) / 120
    assert [s["effect"]["difference"] for s in finding["seeds"]] == [sum(r) / 60 for r in rows]
    text = cli("findings", root)
    assert "held in" in text.stdout and "of 2 seeds" in text.stdout

    # published: the pooled scorecard without per-item differences, one record per replicate, one row in published.json
    results = tmp_path / "results"
    assert cli("findings", root, "--publish", results).returncode == 0
    assert sorted(p.name for p in results.iterdir()) == ["published.json", "replicate-0.json", "replicate-1.json", "scorecard.json"]
    card = read(results / "scorecard.json")
    assert card["run"]["seeds"] == 2 and "differences" not in card["ledger"]["findings"][0]
    assert card["ledger"]["findings"][0]["effect"] == finding["effect"]
    records = [read(results / f"replicate-{r}.json") for r in (0, 1)]
    assert [r["metrics"]["train_seed"] for r in records] == [0, replicate_seed(0, 1)]
    assert [[s["name"] for s in r["stages"]] for r in records] == [["world", "train"]] * 2
    row = read(results / "published.json")
    assert len(row) == 1 and row[0]["seeds"] == 2 and row[0]["span_s"] == [r["span_s"] for r in records]


def test_an_unfinished_replicate_is_refused_with_the_command_that_finishes_it(cli, tmp_path):
    root = tmp_path / "rep"
    done = cli("replicate", "--seeds", "1", "--pipeline", REPLICATED, "--root", root, "--no-report")
    assert done.returncode == 0, done
    (root / "replicate.json").write_text(json.dumps({**read(root / "replicate.json"), "seeds": 2, "members": ["replicate-0", "replicate-1"]}))
    refused = cli("findings", root)
    assert refused.returncode == 2
    assert f"{root}: replicate-1 did not finish; rerun `slm-bench replicate --seeds 2 --root {root}`" in refused.stderr
