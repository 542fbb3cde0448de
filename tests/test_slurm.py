"""`slm-bench submit` and `status` against a real Slurm: a one-node cluster (slurmctld + slurmd + munge) on this machine.

`scripts/slurm_one_node.sh` starts it; `.ci/run` installs Debian's slurm-wlm and munge and sets SLM_BENCH_REQUIRE_SLURM,
so in CI these tests run and never skip. Elsewhere they skip, saying why, when Slurm cannot be started."""
import json
import os
import shutil
import subprocess
import time

import pytest

from conftest import ROOT, SLM_BENCH, tree

SCRIPT = ROOT / "scripts" / "slurm_one_node.sh"
FAILING = ROOT / "tests" / "pipelines" / "failing"


def _skip_or_fail(reason: str):
    if os.environ.get("SLM_BENCH_REQUIRE_SLURM"):
        pytest.fail(f"SLM_BENCH_REQUIRE_SLURM is set but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm():
    "The one-node cluster, started if it is not running; SLURM_CONF points at it for this module's commands."
    missing = [tool for tool in ("slurmctld", "slurmd", "munged", "sbatch") if shutil.which(tool) is None]
    if missing:
        _skip_or_fail(f"Slurm is not installed ({', '.join(missing)} missing; apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        _skip_or_fail("the one-node cluster's daemons need root")
    proc = subprocess.run([str(SCRIPT), "start"], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        _skip_or_fail(f"the one-node cluster did not start: {proc.stderr[-1500:]}")
    conf = proc.stdout.strip().splitlines()[-1].removeprefix("export SLURM_CONF=")
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    yield conf
    if previous is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = previous


def submit(*args, timeout=1800, env=None):
    return subprocess.run([str(SLM_BENCH), "submit", *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def status(run_dir):
    proc = subprocess.run([str(SLM_BENCH), "status", str(run_dir), "--json"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    return proc.returncode, {row["stage"]: row for row in json.loads(proc.stdout)}


def queue() -> list[str]:
    return subprocess.run(["squeue", "--noheader", "--format=%i"], capture_output=True, text=True, check=True).stdout.split()


# Every stage of an all-stage run (the on-request ablations aside): 27 jobs, about 5 minutes on 2 cores
SMOKE_STAGES = ["environment", "synth", "curate", "mixture", "pretrain", "sft", "chat_sft", "preferences", "reward_model",
                "rejection_sampling", "ppo", "gatt", "contamination", "safety", "rlhf_round2", "explanations", "strategy_choice", "orca_sft",
                "orca_evaluate", "pts", "dpo", "workflows", "midtrain", "hallucination", "verifier", "judge_dpo", "evaluate", "grid"]


@pytest.fixture(scope="module")
def smoke_submitted(slurm, tmp_path_factory):
    """The smoke profile through Slurm twice: first with a setting that makes `mixture` fail (its dependents are
    cancelled), then the same command without it, which resumes: the finished stages are not resubmitted."""
    base = tmp_path_factory.mktemp("slurm-smoke")
    run_dir, reports = base / "run", base / "reports"
    common = ["--profile", "smoke", "--run-dir", run_dir, "--report-dir", reports, "--wait", "--poll", "1"]
    clock = time.perf_counter()
    failed = submit(*common, "--set", "mixture.shares={'nope': 1.0}")
    first_s = time.perf_counter() - clock
    first_status = status(run_dir)
    first_index = (reports / "run" / "index.html").read_text()
    clock = time.perf_counter()
    resumed = submit(*common)
    second_s = time.perf_counter() - clock
    print(f"\nslurm smoke: failing submission {first_s:.1f} s, resubmission {second_s:.1f} s")
    return run_dir, reports, failed, first_status, first_index, resumed


@pytest.mark.slow  # the smoke profile through Slurm twice: `make test-slow`
def test_a_failed_stage_cancels_its_dependents_and_the_message_names_it(smoke_submitted):
    run_dir, _, failed, (code, rows), index, _ = smoke_submitted
    assert failed.returncode == 1, failed.stdout[-3000:] + failed.stderr[-3000:]
    assert code == 1
    assert [name for name in rows if name != "(report)"] == SMOKE_STAGES
    assert {name: row["state"] for name, row in rows.items() if row["state"] != "cancelled"} == {
        "environment": "done", "synth": "done", "curate": "done", "mixture": "failed", "(report)": "done"}
    assert rows["mixture"]["detail"] == ("cell error in cell 4: ValueError: shares must name exactly the sources "
                                         "['code', 'problems', 'prose']; got ['nope']")
    assert all(rows[name]["detail"] == "'mixture' failed, so Slurm cancelled it" for name in SMOKE_STAGES[4:])
    assert f"stage 'mixture' failed (job {rows['mixture']['job_id']})" in failed.stdout
    assert f"log: {run_dir}/slurm/mixture-{rows['mixture']['job_id']}.log" in failed.stdout
    log = (run_dir / "slurm" / f"mixture-{rows['mixture']['job_id']}.log").read_text()
    assert "ValueError: shares must name exactly the sources" in log
    # the report job ran after the others (afterany) and links the failed job's log
    assert '<span class="failed">failed</span>' in index
    assert f"Slurm job {rows['mixture']['job_id']} (failed) &middot; <a href='logs/mixture-{rows['mixture']['job_id']}.log'>log</a>" in index


@pytest.mark.slow  # the smoke profile through Slurm twice: `make test-slow`
def test_the_resubmission_resumes_and_every_stage_finishes(smoke_submitted):
    run_dir, reports, _, (_, first), _, resumed = smoke_submitted
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "finished and unchanged, not submitted: environment, synth, curate\n" in resumed.stdout
    code, rows = status(run_dir)
    assert code == 0 and {row["state"] for row in rows.values()} == {"done"}
    # the three finished stages keep their first jobs; every other stage (and the report) got a new one
    assert {name for name in rows if rows[name]["job_id"] == first[name]["job_id"]} == {"environment", "synth", "curate"}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {s["name"]: s["status"] for s in summary["stages"] if s["name"] in SMOKE_STAGES} == {name: "ok" for name in SMOKE_STAGES}
    assert summary["selected"] == SMOKE_STAGES and summary["status"] == "ok"  # the report job rewrote it for the submission
    assert {s["name"]: s["action"] for s in summary["stages"] if s["name"] in SMOKE_STAGES} == {
        name: "cached" if name in ("environment", "synth", "curate") else "ran" for name in SMOKE_STAGES}
    assert 0 <= summary["metrics"]["sft_verify@N@1"] <= summary["metrics"]["sft_pass@k"] <= 1  # evaluate's figures, through Slurm
    assert '<span class="ok">ok</span>' in (reports / "run" / "index.html").read_text()


@pytest.mark.slow  # the smoke profile through Slurm twice: `make test-slow`
def test_each_job_waits_for_the_jobs_of_its_inputs(smoke_submitted):
    "The job graph: afterok on exactly the jobs of the stage's inputs submitted with it; the report job afterany on all."
    from slm_bench.pipeline.stages import discover_stages

    run_dir = smoke_submitted[0]
    record = json.loads((run_dir / "submission.json").read_text())
    assert len(record["submissions"]) == 2
    first, second = (entry["jobs"] for entry in record["submissions"])
    assert record["submissions"][1]["skipped"] == ["environment", "synth", "curate"]
    stages = discover_stages(ROOT / "nbs" / "stages")
    for jobs in (first, second):
        for name, job in jobs.items():
            if name == "(report)":
                expected = "--dependency=afterany:" + ":".join(jobs[n]["job_id"] for n in jobs if n != "(report)")
            else:
                ups = [up for up in stages[name].inputs if up in jobs]
                expected = "--dependency=afterok:" + ":".join(jobs[up]["job_id"] for up in ups) if ups else None
            dependency = [option for option in job["options"] if option.startswith("--dependency=")]
            assert dependency == ([expected] if expected else []), name
    assert "--exclusive" in first["environment"]["options"]  # it measures the machine: the node to itself


def test_refused_requests_exit_2_and_queue_nothing(slurm, tmp_path):
    run_dir = tmp_path / "run"
    before = queue()
    cases = {
        "partition": (["--partition", "nope"], "Slurm would not accept the job for ok (options: --partition=nope): Slurm said: "
                                              "sbatch: error: invalid partition specified: nope"),
        "gpus": (["--gpus-per-stage", "1"], "Slurm would not accept the job for ok (options: --gres=gpu:1): Slurm said: "
                                           "sbatch: error: Invalid generic resource (gres) specification"),
        "several gpus, one process": (["--gpus-per-stage", "2"], "--gpus-per-stage 2: a stage trains on one GPU unless the run "
                                                                 "trains with several processes; add --set train.strategy=ddp"),
        "several gpus, ddp": (["--gpus-per-stage", "2", "--set", "train.strategy=ddp"],
                              "Slurm would not accept the job for ok (options: --gres=gpu:2): Slurm said: "
                              "sbatch: error: Invalid generic resource (gres) specification"),
        "memory syntax": (["--mem", "lots"], "--mem 'lots' is not a Slurm memory size"),
        # the smoke profile's TinyGSM stages against a 16 MB job: every one that trains or samples is estimated above it
        "memory estimate": (["--pipeline", ROOT / "nbs" / "stages", "--recipe", "tinygsm", "--mem", "16M"],
                            "slm-bench submit: error: 5 stage(s) will not fit a job's memory (--mem) (0.015625 GiB):\n"
                            "  pretrain: about 0.1 GiB (weights 4.1 MiB, gradients 4.1 MiB, optimizer 8.3 MiB, activations 0.1 GiB)\n"),
    }
    for case, (extra, message) in cases.items():
        pipeline = [] if "--pipeline" in extra else ["--pipeline", FAILING]
        proc = submit(*pipeline, "--profile", "smoke", "--run-dir", run_dir, *extra, timeout=120)
        assert proc.returncode == 2, (case, proc.stdout, proc.stderr)
        assert message in proc.stderr, (case, proc.stderr)
        assert "Traceback" not in proc.stderr, case
    assert tree(run_dir) == {} and queue() == before


def test_a_dry_run_prints_the_jobs_and_needs_no_slurm(tmp_path):
    "`--dry-run` shows each job's sbatch options and what it waits for, without Slurm on PATH, and writes nothing."
    empty = tmp_path / "bin"
    empty.mkdir()
    proc = submit("--pipeline", FAILING, "--profile", "smoke", "--run-dir", tmp_path / "run", "--dry-run", "--partition", "gpu",
                  "--gpus-per-stage", "1", "--mem", "32G", env={"PATH": str(empty)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith("note: no stage's memory could be estimated (no model to estimate on: the pipeline has no pretrain "
                                "stage (pass --model PRESET)): --mem/--gpu-mem not checked\n")
    assert proc.stdout.splitlines()[1:] == [
        "  ok: sbatch --partition=gpu --mem=32G --gres=gpu:1",
        "  boom: sbatch --partition=gpu --mem=32G --gres=gpu:1 --dependency=afterok:<ok>",
        "  (report): sbatch --partition=gpu --dependency=afterany:<ok,boom>"]
    assert tree(tmp_path / "run") == {}


def test_without_slurm_on_path_nothing_is_submitted(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    proc = submit("--pipeline", FAILING, "--profile", "smoke", "--run-dir", tmp_path / "run", env={"PATH": str(empty)}, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == ("slm-bench submit: error: Slurm is not available here: sbatch, squeue, scancel not on PATH. Submit from "
                           "a machine of the cluster (its login node), or run the stages on this machine with `slm-bench run` "
                           "(the same options, without the Slurm ones)\n")
    assert tree(tmp_path / "run") == {}


def _wait_for(run_dir, stage, states, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        code, rows = status(run_dir)
        if rows[stage]["state"] in states:
            return code, rows
        time.sleep(0.5)
    raise AssertionError(f"{stage} never reached {states}: {rows[stage]}")


def test_a_local_run_folder_warns_and_running_jobs_block_a_second_submission(slurm, tmp_path):
    run_dir = tmp_path / "run"
    first = submit("--pipeline", FAILING, "--profile", "smoke", "--run-dir", run_dir, "--no-report", "--set", "boom.mode=sleep", timeout=120)
    assert first.returncode == 0, first.stderr
    assert first.stderr.startswith(f"warning: the run folder {run_dir} is on a local file system (")  # pytest's tmp: not shared
    jobs = json.loads((run_dir / "submission.json").read_text())["submissions"][0]["jobs"]
    try:
        _wait_for(run_dir, "boom", ["running"])  # boom sleeps 600 s in its cell
        again = submit("--pipeline", FAILING, "--profile", "smoke", "--run-dir", run_dir, "--no-report", timeout=120)
        assert again.returncode == 2
        assert again.stderr.endswith(f"jobs of an earlier submission of {run_dir} are still queued or running: boom (job "
                                     f"{jobs['boom']['job_id']}, running); wait for them (slm-bench status {run_dir} --wait) "
                                     f"or cancel them (scancel {jobs['boom']['job_id']})\n"), again.stderr
        assert len(json.loads((run_dir / "submission.json").read_text())["submissions"]) == 1
    finally:
        subprocess.run(["scancel", *(job["job_id"] for job in jobs.values())], check=True)
    code, rows = _wait_for(run_dir, "boom", ["cancelled", "failed", "done", "unknown"])
    assert code == 1 and (rows["ok"]["state"], rows["boom"]["state"]) == ("done", "cancelled")
