"""The runner end to end: real stage notebooks executed by papermill under the real `slm-bench` kernel."""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import nbformat
import pytest

from conftest import PIPELINES, SLM_BENCH
from slm_bench.core.config import KEEP_FREED_MEMORY

BASIC = PIPELINES / "basic"
FAILING = PIPELINES / "failing"
PARALLEL = PIPELINES / "parallel"
RECIPES = PIPELINES / "recipes"


def read(path: Path):
    return json.loads(path.read_text())


def test_environment_stage_through_the_real_kernel(cli, tmp_path):
    run_dir, reports = tmp_path / "run", tmp_path / "reports"
    # MPLBACKEND in the caller's environment must not make figures vanish (STACK.md trap): the runner strips it.
    result = cli("run", "--profile", "smoke", "--stages", "environment", "--run-dir", run_dir, "--report-dir", reports,
                 env={"MPLBACKEND": "agg"})
    assert result.returncode == 0, result
    assert "[1/1] environment  running" in result.stdout and "[1/1] environment  ok" in result.stdout
    assert f"report: {reports / 'run' / 'index.html'}" in result.stdout

    stage = run_dir / "environment"
    manifest = read(stage / "manifest.json")
    assert manifest["status"] == "ok" and manifest["profile"] == "smoke"
    assert manifest["parameters"]["sizes"] == [256, 512] and manifest["parameters"]["repeats"] == 3
    assert set(manifest["outputs"]) >= {"environment.json", "matmul.json", "matmul.png", "metrics.json"}
    assert manifest["versions"]["python"] and manifest["versions"]["torch"]

    matmul = read(stage / "matmul.json")
    assert [r["n"] for r in matmul] == [256, 512]
    for r in matmul:  # GFLOP/s is 2n^3 over the median of the recorded repeats
        times = sorted(r["seconds"])
        assert len(times) == 3 and r["median_s"] == times[1]
        assert r["gflops"] == pytest.approx(2 * r["n"] ** 3 / times[1] / 1e9)
    metrics = read(stage / "metrics.json")
    assert metrics["peak_gflops"] == pytest.approx(max(r["gflops"] for r in matmul), rel=1e-3, abs=0.005)  # recorded to 2 decimals
    assert metrics["device"] == "cpu" and metrics["dtype"] == "float32"

    env = read(stage / "environment.json")
    assert env["versions"]["torch"] == manifest["versions"]["torch"] and env["cpu"]["logical_cores"] >= 1
    # what decided the numbers, as the stage's kernel saw it: matches what the stage itself measured in environment.json
    determined = manifest["determined_by"]
    assert determined["seeds"] == {"seed": 0} and determined["python_hash_seed"] == os.environ.get("PYTHONHASHSEED", "0")
    assert (determined["torch_threads"], determined["cpu"]["model"]) == (env["cpu"]["torch_threads"], env["cpu"]["model"])
    assert determined["env"]["MKL_CBWR"] == "AUTO,STRICT"  # cpu.mkl_cbwr's default reached the kernel: matmuls ignore the thread count
    assert determined["env"]["GLIBC_TUNABLES"] == KEEP_FREED_MEMORY  # cpu.glibc_tunables's default reached it too
    assert manifest["versions"]["tokenizers"] and not (stage / ".runtime.json").exists()  # moved into the manifest

    executed = nbformat.read(stage / "notebook.ipynb", as_version=4)
    assert executed.metadata.kernelspec.name == "slm-bench"
    assert executed.metadata.papermill["parameters"]["run_dir"] == str(run_dir)
    images = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, "the matmul figure must be inline in the executed notebook"

    summary = read(run_dir / "summary.json")
    assert summary["status"] == "ok" and summary["stages"][0]["action"] == "ran"
    assert summary["stages"][0]["metrics"]["peak_gflops"] == metrics["peak_gflops"]
    assert (reports / "run" / "environment.html").is_file()
    index = (reports / "run" / "index.html").read_text()
    assert "src='figures/environment/matmul.png'" in index
    assert (reports / "run" / "figures" / "environment" / "matmul.png").read_bytes() == (stage / "matmul.png").read_bytes()


def test_cache_force_and_invalidation(cli, tmp_path):
    run_dir = tmp_path / "run"
    base = ("run", "--pipeline", BASIC, "--run-dir", run_dir, "--no-report")

    first = cli(*base)
    assert first.returncode == 0, first
    assert "source  ok" in first.stdout and "double  ok" in first.stdout
    assert read(run_dir / "double" / "doubled.json") == [0, 2, 4]
    manifests = {s: (run_dir / s / "manifest.json").read_bytes() for s in ("source", "double")}

    again = cli(*base)
    assert again.returncode == 0, again
    assert "source  cached" in again.stdout and "double  cached" in again.stdout
    assert {s: (run_dir / s / "manifest.json").read_bytes() for s in manifests} == manifests
    assert [s["action"] for s in read(run_dir / "summary.json")["stages"]] == ["cached", "cached"]

    downstream = cli(*base, "--set", "double.factor=3")  # only the stage whose parameter changed reruns
    assert "source  cached" in downstream.stdout and "double  ok" in downstream.stdout, downstream
    assert read(run_dir / "double" / "doubled.json") == [0, 3, 6]
    assert (run_dir / "source" / "manifest.json").read_bytes() == manifests["source"]

    upstream = cli(*base, "--set", "double.factor=3", "--set", "source.n=4")  # new input fingerprint reruns downstream
    assert "source  ok" in upstream.stdout and "double  ok" in upstream.stdout, upstream
    assert read(run_dir / "double" / "doubled.json") == [0, 3, 6, 9]

    forced = cli(*base, "--set", "double.factor=3", "--set", "source.n=4", "--stages", "double", "--force")
    assert forced.returncode == 0, forced
    stage_lines = [line for line in forced.stdout.splitlines() if line.startswith("[")]  # the scorecard after them may name any stage
    assert any(line.startswith("[1/1] double  ok") for line in stage_lines) and not any("source" in line for line in stage_lines), forced.stdout
    summary = read(run_dir / "summary.json")
    assert {s["name"]: s["action"] for s in summary["stages"]} == {"source": "not selected", "double": "ran"}


def test_recipe_runs_its_stages_and_what_they_need(cli, tmp_path):
    run_dir = tmp_path / "run"
    base = ("run", "--pipeline", RECIPES, "--run-dir", run_dir, "--no-report")

    beta = cli(*base, "--recipe", "beta")
    assert beta.returncode == 0, beta
    assert [line.split()[:3] for line in beta.stdout.splitlines() if line.startswith("[") and "running" not in line] == [
        ["[1/2]", "numbers", "ok"], ["[2/2]", "largest", "ok"]]
    assert read(run_dir / "largest" / "largest.json") == 3 and not (run_dir / "total").exists()
    summary = read(run_dir / "summary.json")
    assert {s["name"]: (s["recipe"], s["action"]) for s in summary["stages"]} == {
        "numbers": ("common", "ran"), "total": ("alpha", "not selected"), "largest": ("beta", "ran")}

    alpha = cli(*base, "--recipe", "alpha")  # the shared stage is reused, not rerun
    assert alpha.returncode == 0, alpha
    assert "[1/2] numbers  cached" in alpha.stdout and "[2/2] total    ok" in alpha.stdout, alpha
    assert read(run_dir / "total" / "total.json") == 6


def test_editing_a_subpackage_file_invalidates_the_cache(cli, tmp_path):
    "The cache key covers every file of the library, not only the top folder: run against a copy of it and edit deep inside."
    import shutil

    import slm_bench
    library = tmp_path / "lib"
    shutil.copytree(Path(slm_bench.__file__).parent, library / "slm_bench", ignore=shutil.ignore_patterns("__pycache__"))
    env = {"PYTHONPATH": str(library)}
    base = ("run", "--pipeline", RECIPES, "--recipe", "alpha", "--run-dir", tmp_path / "run", "--no-report")
    assert cli(*base, env=env).returncode == 0
    again = cli(*base, env=env)
    assert "numbers  cached" in again.stdout and "total    cached" in again.stdout, again

    deep = library / "slm_bench" / "train" / "dpo.py"
    deep.write_text(deep.read_text() + "\n# an edit deep in a subpackage\n")
    edited = cli(*base, env=env)
    assert edited.returncode == 0, edited
    assert "[1/2] numbers  ok" in edited.stdout and "[2/2] total    ok" in edited.stdout, edited


def _wait_for(predicate, timeout=60.0, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) counts as dead
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("how", ["kill", "interrupt"])
def test_resume_after_killed_or_interrupted_run(cli, tmp_path, how):
    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    gate.write_text("hold")
    args = [str(SLM_BENCH), "run", "--pipeline", str(BASIC), "--run-dir", str(run_dir), "--no-report", "--set", f"double.gate={gate}"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for(lambda: (run_dir / "double" / "started.txt").exists(), what="stage double to start")
        kernel_pid = int((run_dir / "double" / "kernel.pid").read_text())
        if how == "kill":
            os.killpg(proc.pid, signal.SIGKILL)  # the runner dies without any chance to clean up
            proc.wait(timeout=30)
        else:
            proc.send_signal(signal.SIGINT)  # Ctrl-C
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 130 and "rerun the same command to resume" in err, err
            assert read(run_dir / "summary.json")["status"] == "interrupted"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _wait_for(lambda: not _pid_alive(kernel_pid), timeout=30, what="the orphaned kernel to exit")

    # half-written: files exist, but without a manifest the stage is not finished
    assert (run_dir / "double" / "started.txt").exists() and not (run_dir / "double" / "manifest.json").exists()
    assert read(run_dir / "source" / "manifest.json")["status"] == "ok"

    gate.unlink()
    resumed = cli("run", "--pipeline", BASIC, "--run-dir", run_dir, "--no-report", "--set", f"double.gate={gate}")
    assert resumed.returncode == 0, resumed
    assert "source  cached" in resumed.stdout and "double  ok" in resumed.stdout
    metrics = read(run_dir / "double" / "metrics.json")
    assert metrics["resumed"] is True and metrics["attempt"] == 2 and metrics["saw_earlier_attempt"] is True
    assert read(run_dir / "double" / "manifest.json")["status"] == "ok"
    assert not (run_dir / "double" / ".attempt.json").exists()

    forced = cli("run", "--pipeline", BASIC, "--run-dir", run_dir, "--no-report", "--set", f"double.gate={gate}", "--force")
    assert read(run_dir / "double" / "metrics.json")["saw_earlier_attempt"] is False, forced  # --force starts clean


@pytest.mark.parametrize(
    "mode, extra, kind, detail",
    [
        ("raise", [], "cell error", "ValueError: planted failure"),
        ("sleep", ["--cell-timeout", "3"], "timeout", "CellTimeoutError: a cell ran longer than --cell-timeout 3 s"),
        ("die", [], "dead kernel", "DeadKernelError: the kernel died"),
        ("no_output", [], "missing outputs", "did not write its declared outputs: never.txt"),
    ],
)
def test_failing_stage_exit_1_and_message(cli, tmp_path, mode, extra, kind, detail):
    run_dir, reports = tmp_path / "run", tmp_path / "reports"
    result = cli("run", "--pipeline", FAILING, "--run-dir", run_dir, "--report-dir", reports, "--set", f"boom.mode={mode}", *extra)
    assert result.returncode == 1, result
    notebook = FAILING / "02_boom.ipynb"
    expected_cell = "" if mode == "no_output" else " in cell 5 of"
    assert f"stage 'boom' failed ({kind}){expected_cell}" in result.stderr, result
    assert detail in result.stderr
    if mode != "no_output":
        assert f"cell 5 of {notebook}" in result.stderr and "cell starts: def planted_failure(mode):" in result.stderr
    executed = run_dir / "boom" / "notebook.ipynb"
    assert f"executed notebook: {executed}" in result.stderr and executed.is_file()
    assert f"report page: {reports / 'run' / 'boom.html'}" in result.stderr and (reports / "run" / "boom.html").is_file()

    manifest = read(run_dir / "boom" / "manifest.json")
    assert manifest["status"] == "failed" and manifest["error"]["kind"] == kind
    summary = read(run_dir / "summary.json")
    assert summary["status"] == "failed"
    assert {s["name"]: s["status"] for s in summary["stages"]} == {"ok": "ok", "boom": "failed"}

    # a failed stage is never taken for a finished one: the next run reruns it
    rerun = cli("run", "--pipeline", FAILING, "--run-dir", run_dir, "--no-report", "--set", "boom.mode=raise")
    assert rerun.returncode == 1 and "ok    cached" in rerun.stdout and "boom  FAILED" in rerun.stdout, rerun


def test_a_stage_that_refuses_its_input_exits_2_and_says_why(cli, tmp_path):
    "A stage notebook that raises BadInput (its data or parameters are invalid) is a bad request: exit 2, its message, no output."
    run_dir = tmp_path / "run"
    result = cli("run", "--pipeline", FAILING, "--run-dir", run_dir, "--no-report", "--set", "boom.mode=bad_input")
    assert result.returncode == 2, result
    assert "stage 'boom' failed (cell error) in cell 5 of" in result.stderr, result
    assert "BadInput: planted bad input: rows.jsonl, row 3: unknown rating 'great'" in result.stderr
    assert read(run_dir / "boom" / "manifest.json")["status"] == "failed"
    assert not (run_dir / "boom" / "never.txt").exists()


def test_concurrent_run_on_same_folder_is_refused(cli, tmp_path):
    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    gate.write_text("hold")
    proc = subprocess.Popen([str(SLM_BENCH), "run", "--pipeline", str(BASIC), "--run-dir", str(run_dir), "--no-report",
                             "--set", f"source.gate={gate}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: (run_dir / "source" / "kernel.pid").exists(), what="the first run to start")
        second = cli("run", "--pipeline", BASIC, "--run-dir", run_dir, "--no-report")
        assert second.returncode == 2 and "is in use by another slm-bench run" in second.stderr, second
    finally:
        gate.unlink()
        proc.communicate(timeout=120)
    assert proc.returncode == 0


def test_a_stalled_kernel_is_stopped_and_the_stage_runs_again(cli, tmp_path):
    "A cell that waits on nothing (as when nbclient loses a reply, #312) is stopped by the watchdog; the retry resumes and finishes."
    run_dir = tmp_path / "run"
    result = cli("run", "--pipeline", FAILING, "--run-dir", run_dir, "--no-report", "--set", "boom.mode=nap_once", "--stall-timeout", "4")
    assert result.returncode == 0, result
    assert "boom: the kernel stalled in cell 5 (no CPU for 4 s); running the stage again" in result.stdout, result
    manifest = read(run_dir / "boom" / "manifest.json")
    assert (manifest["status"], manifest["attempt"]) == ("ok", 2)  # the second attempt, in the same folder
    assert (run_dir / "boom" / "napped").read_text() == "the first attempt slept here"
    assert manifest["duration_s"] < 60  # the retry did not nap (the first attempt's sleep is 600 s)


def test_a_stalled_kernel_fails_the_stage_when_no_retry_is_left(tmp_path):
    from slm_bench.core.errors import StageFailed
    from slm_bench.pipeline.runner import RunOptions, plan_run, run_pipeline

    run_dir, log = tmp_path / "run", []
    plan = plan_run(RunOptions(FAILING, run_dir, sets=["boom.mode=nap_once"], stall_timeout=4, stall_retries=0))
    with pytest.raises(StageFailed, match=r"stage 'boom' failed \(stalled\) in cell 5 of"):
        run_pipeline(plan, log=log.append)
    error = read(run_dir / "boom" / "manifest.json")["error"]
    assert (error["kind"], error["ename"]) == ("stalled", "KernelStalled")
    assert error["evalue"].startswith("the kernel's processes used no CPU for 4 s while a cell ran")


def _cores() -> int:
    from slm_bench.pipeline.schedule import available_cores

    return available_cores()


@pytest.mark.skipif(_cores() < 2, reason="sharing cores between stages needs at least 2")
def test_jobs_run_independent_stages_side_by_side_sharing_the_cores(cli, tmp_path):
    "--jobs 2: the exclusive stage alone, left beside right with half the cores each, left takes right's cores when it ends."
    run_dir, cores = tmp_path / "run", _cores()
    half = cores // 2
    result = cli("run", "--pipeline", PARALLEL, "--run-dir", run_dir, "--no-report", "--jobs", "2", "--set", f"left.cores={cores}")
    assert result.returncode == 0, result
    plural = lambda n: f"{n} thread{'s' * (n > 1)}"
    for line in (f"up to 2 at once on {cores} cores", f"[1/4] probe  running ... ({plural(cores)})",
                 f"[2/4] left   running ... ({plural(cores - half)}; beside right)", f"[3/4] right  running ... ({plural(half)}; beside left)",
                 f"[4/4] join   running ... ({plural(cores)})"):
        assert line in result.stdout, (line, result)
    window = {name: read(run_dir / name / "window.json") for name in ("probe", "left", "right", "join")}
    overlaps = lambda a, b: window[a]["start"] < window[b]["end"] and window[b]["start"] < window[a]["end"]
    assert window["right"]["saw_left"] and overlaps("left", "right")  # right saw left running: they ran side by side
    assert not any(overlaps("probe", other) for other in ("left", "right", "join"))  # exclusive: alone
    assert (window["probe"]["threads"], window["right"]["threads"], window["join"]["threads"]) == (cores, half, cores)
    assert window["left"]["threads"] == [cores - half, cores]  # its share, then every core once right had finished
    history = read(run_dir / "left" / "manifest.json")["threads"]
    assert [threads for _, threads in history] == [cores - half, cores] and history[0][0] == 0.0 < history[1][0]
    assert read(run_dir / "join" / "manifest.json")["threads"] == [[0.0, cores]]


@pytest.mark.skipif(_cores() < 2, reason="sharing cores between stages needs at least 2")
def test_jobs_a_failure_lets_the_running_stage_finish_and_starts_nothing_new(cli, tmp_path):
    "--jobs 2: right fails while left runs; left finishes (with right's cores), join never starts; the rerun resumes."
    run_dir, cores = tmp_path / "run", f"left.cores={_cores()}"
    failed = cli("run", "--pipeline", PARALLEL, "--run-dir", run_dir, "--no-report", "--jobs", "2", "--set", "right.fail=true", "--set", cores)
    assert failed.returncode == 1, failed
    assert "[3/4] right  FAILED" in failed.stdout and "[2/4] left   ok" in failed.stdout, failed
    assert "RuntimeError: right fails on purpose" in failed.stderr, failed
    assert read(run_dir / "left" / "manifest.json")["status"] == "ok"  # finished after the failure: its work is kept
    assert not (run_dir / "join").exists()  # never started
    summary = read(run_dir / "summary.json")
    assert summary["status"] == "failed" and {s["name"]: s["action"] for s in summary["stages"]}["right"] == "failed"
    again = cli("run", "--pipeline", PARALLEL, "--run-dir", run_dir, "--no-report", "--jobs", "2", "--set", cores)
    assert again.returncode == 0, again
    assert "[2/4] left   cached" in again.stdout and "[4/4] join   ok" in again.stdout, again


@pytest.mark.skipif(_cores() < 2, reason="sharing cores between stages needs at least 2")
def test_jobs_ctrl_c_interrupts_every_running_stage_and_the_rerun_resumes_them(cli, tmp_path):
    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    gate.write_text("hold")
    args = [str(SLM_BENCH), "run", "--pipeline", str(PARALLEL), "--run-dir", str(run_dir), "--no-report", "--jobs", "2",
            "--set", f"right.gate={gate}", "--set", "left.cores=1000"]  # left waits for cores it never gets, right for the gate
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for(lambda: (run_dir / "right" / "saw_left.txt").exists(), what="left and right to run side by side")
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and "interrupted during stage 'left', 'right'; rerun the same command to resume" in err, (out, err)
    assert "[2/4] left   interrupted; run the same command again to resume" in out and "[3/4] right  interrupted;" in out, out
    assert read(run_dir / "summary.json")["status"] == "interrupted"
    assert not (run_dir / "left" / "manifest.json").exists() and not (run_dir / "right" / "manifest.json").exists()

    gate.unlink()
    resumed = cli("run", "--pipeline", PARALLEL, "--run-dir", run_dir, "--no-report", "--jobs", "2", "--set", f"right.gate={gate}",
                  "--set", f"left.cores={_cores()}")
    assert resumed.returncode == 0, resumed
    assert "[1/4] probe  cached" in resumed.stdout and "[4/4] join   ok" in resumed.stdout, resumed
    assert read(run_dir / "right" / "manifest.json")["attempt"] == 2  # resumed in its folder


def test_jobs_must_be_positive(cli, tmp_path):
    result = cli("run", "--pipeline", PARALLEL, "--run-dir", tmp_path / "run", "--jobs", "0")
    assert result.returncode == 2 and "--jobs must be at least 1, got 0" in result.stderr, result
    assert not (tmp_path / "run").exists()
