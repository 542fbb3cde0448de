"""Real attacks on the sandbox, as root and as an unprivileged user: each must end exactly as expected, stopped by
the layer named in tests/sandbox_attacks.py, with the pool still working; refusals where the kernel says no."""
import json
import os
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import uuid

import pytest

from sandbox_attacks import ROOT, attacks, forgeries, run_attacks, run_forgeries
from slm_bench.evals.isolation import missing_layers
from slm_bench.evals.sandbox import Sandbox
from slm_bench.evals.tasks import benchmark_file, get_task

REPORTS = ROOT / "reports" / "tests"
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
IS_ROOT = os.getuid() == 0


class Listener:
    "A TCP listener on 127.0.0.1 that records whatever reaches it."

    def __init__(self):
        self.sock, self.received = socket.socket(), []
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.sock.settimeout(0.2)
        self.port, self.stop = self.sock.getsockname()[1], threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
                self.received.append(conn.recv(100))
                conn.close()
            except OSError:
                pass

    def close(self):
        self.stop.set()
        self.thread.join(timeout=2)
        self.sock.close()


@pytest.fixture
def listener():
    heard = Listener()
    yield heard
    heard.close()


@pytest.fixture
def context(tmp_path, listener):
    "Targets on the host, readable by anyone (so only the sandbox can stop an unprivileged reader)."
    gold = tmp_path / "runs" / "tiny" / "synth" / "train.jsonl"
    gold.parent.mkdir(parents=True)
    gold.write_text('{"question": "2 + 2?", "answer": 4}\n')
    for folder in [gold.parent, *gold.parent.parents]:
        if str(folder).startswith(tempfile_root()):
            folder.chmod(folder.stat().st_mode | 0o005)  # pytest's folders are private to their owner
    gold.chmod(0o644)
    return {"project_file": str(ROOT / "README.md"), "gold_file": str(gold), "benchmark_file": str(benchmark_file("gsm8k")),
            "host_pid": os.getpid(), "port": listener.port, "marker": f"/tmp/slm-marker-{uuid.uuid4().hex}",
            "escape": f"/tmp/slm-escape-{uuid.uuid4().hex}", "venv_site": sysconfig.get_paths()["purelib"]}


def tempfile_root() -> str:
    "Where pytest makes its temporary folders."
    return os.path.realpath(tempfile.gettempdir()) + "/pytest-of-"


def unprivileged_python() -> list[str]:
    "A Python that `nobody` can run with this project importable: this one if nobody can reach it, else the system's."
    for python in (os.path.realpath(sys.executable), "/usr/bin/python3"):
        reachable = "import os, sys; os.stat(os.path.realpath(sys.executable)); import sysconfig; os.listdir(sysconfig.get_paths()['stdlib'])"
        if python and subprocess.run([*NOBODY, python, "-c", reachable], capture_output=True, cwd="/").returncode == 0:
            return [python]
    pytest.fail("no Python that the unprivileged user can execute")


def run_as_nobody(script_args: list[str]) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(ROOT), sysconfig.get_paths()["purelib"], str(ROOT / "tests")])
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": path, "LANG": "C.UTF-8"}
    return subprocess.run([*NOBODY, *unprivileged_python(), *script_args], capture_output=True, text=True, env=env, cwd="/", timeout=600)


def attack_report(user: str, ctx: dict) -> dict:
    if user == "unprivileged user" and IS_ROOT:
        proc = run_as_nobody([str(ROOT / "tests" / "sandbox_attacks.py"), json.dumps(ctx)])
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])
    with Sandbox(workers=1, timeout=3.0, isolation="namespaces") as box:
        return {"isolation": box.isolation, "attacks": run_attacks(box, ctx), "forgeries": run_forgeries(box)}


@pytest.mark.parametrize("user", ["root", "unprivileged user"])
def test_every_attack_is_contained(user, context, listener):
    if user == "root" and not IS_ROOT:
        pytest.skip("the root half of the suite needs root (CI runs as root and runs both halves)")
    report = attack_report(user, context)
    assert missing_layers(report["isolation"]) == [], report["isolation"]
    rows, wrong = [], []
    for attack in attacks(context):
        got = report["attacks"][attack.name]
        expected = attack.expected
        if expected[2] == "<pid>":  # a pid inside the job's pid namespace: any small positive number
            expected = [True, None, got["outcome"][2] if isinstance(got["outcome"][2], int) and got["outcome"][2] > 1 else "<pid>"]
        if got["outcome"] != expected or got.get("after") != attack.expected_after or not got["works"] \
                or attack.layer not in report["isolation"]:
            wrong.append(f"{attack.name}: expected {expected} then {attack.expected_after} (stopped by {attack.layer}), "
                         f"got {got['outcome']} ({got['message'][:200]}) then {got.get('after')}, pool works: {got['works']}")
        rows.append(f"| {attack.name} | {got['outcome'][1] or got['outcome'][2]} | {attack.layer} |")
    for forgery in forgeries():  # judged outside the sandbox: a forged report or value fails, by name
        got = report["forgeries"][forgery.name]
        if got != forgery.expected:
            wrong.append(f"{forgery.name}: expected {forgery.expected}, got {got}")
        rows.append(f"| {forgery.name} | {got[1]} | check outside the sandbox |")
    REPORTS.mkdir(parents=True, exist_ok=True)
    name = "root" if user == "root" else "unprivileged"
    (REPORTS / f"sandbox_attacks_{name}.md").write_text(
        f"# Attacks on the sandbox as {user}\n\nlayers: {', '.join(report['isolation'])}\n\n| attack | outcome | stopped by |\n"
        "|---|---|---|\n" + "\n".join(rows) + "\n")
    assert wrong == [], "\n".join(wrong)
    assert (os.path.exists(context["marker"]), os.path.exists(context["escape"])) == (False, False)  # nothing reached the host
    probe = socket.create_connection(("127.0.0.1", context["port"]))  # the listener hears the host, so its silence counts
    probe.sendall(b"host")
    probe.close()
    time.sleep(0.5)
    assert listener.received == [b"host"]


NO_USERNS = ["unshare", "--user", "--map-root-user", "--mount", "--pid", "--fork", "--mount-proc", "sh", "-c"]
REFUSAL_SCRIPT = ("from slm_bench.evals.isolation import IsolationUnavailable\nfrom slm_bench.evals.sandbox import Sandbox\n"
                  "try:\n    Sandbox(workers=1)\n    print('started')\nexcept IsolationUnavailable as error:\n    print(error)\n")


@pytest.mark.parametrize("user", ["root", "unprivileged user"])
def test_a_kernel_without_user_namespaces_is_refused(user, tmp_path):
    "Inside a user namespace whose max_user_namespaces is 0, the kernel refuses bwrap its user namespace."
    if user == "root" and not IS_ROOT:
        pytest.skip("needs root")
    script = tmp_path / "refuse.py"
    script.write_text(REFUSAL_SCRIPT)
    script.chmod(0o644)
    tmp_path.chmod(0o755)
    python = unprivileged_python() if user == "unprivileged user" and IS_ROOT else [os.path.realpath(sys.executable)]
    shell = f"echo 0 > /proc/sys/user/max_user_namespaces && cd / && exec {python[0]} {script}"
    prefix = NOBODY if user == "unprivileged user" and IS_ROOT else []
    path = os.pathsep.join([str(ROOT), sysconfig.get_paths()["purelib"]])
    proc = subprocess.run([*prefix, *NO_USERNS, shell], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": path, "LANG": "C.UTF-8"})
    assert proc.stdout.startswith("the kernel refuses this user a user namespace (bwrap: bwrap: Creating new namespace failed"), \
        proc.stdout + proc.stderr[-2000:]
    assert "Sandbox(isolation='process-only')" in proc.stdout


def test_without_bubblewrap_the_sandbox_refuses_by_name(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    from slm_bench.evals.isolation import IsolationUnavailable
    with pytest.raises(IsolationUnavailable, match="sets them up with bubblewrap, which is not installed: `apt install bubblewrap`"):
        Sandbox(workers=1)


def test_process_only_is_explicit_and_the_stage_records_it(tmp_path):
    "An opted-out sandbox lists no kernel layer, and a stage that used it records so in its metrics (the report shows them)."
    code = ("from slm_bench.pipeline.context import open_stage\nfrom slm_bench.evals.sandbox import Sandbox\n"
            f"ctx = open_stage({{'name': 'curate', 'recipe': 'common'}}, {str(tmp_path)!r})\n"
            "import json\nwith Sandbox(workers=1) as box:\n    print('LAYERS', json.dumps(box.isolation))\n    assert box.run('x = 1').ok\nctx.record(kept=1)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SLM_BENCH_SANDBOX_ISOLATION": "process-only"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    layers = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("LAYERS "))[len("LAYERS "):])
    kernel = [] if IS_ROOT else ["no capabilities"]  # a normal user holds none anyway; root keeps all of them
    assert layers == ["process-only", "separate process", "fork per program", *kernel, "not dumpable", "rlimits", "deadline",
                      "stdin /dev/null", "result cap"]
    metrics = json.loads(next(tmp_path.rglob("metrics.json")).read_text())
    assert metrics == {"kept": 1, "sandbox_isolation": "process-only (no kernel isolation)"}


def test_real_benchmarks_pass_through_the_isolated_sandbox():
    "Every canonical HumanEval solution and every GSM8K gold answer as a TinyGSM program pass in the namespaced sandbox."
    with Sandbox(isolation="namespaces") as box:
        assert missing_layers(box.isolation) == []
        humaneval = get_task("humaneval")
        problems = humaneval.load()
        judged = humaneval.judge_many(problems, [p.row["canonical_solution"] for p in problems], sandbox=box)
        assert (len(judged), sum(j.correct for j in judged)) == (164, 164)
        tinygsm = get_task("tinygsm")
        problems = tinygsm.load()
        judged = tinygsm.judge_many(problems, [f"    result = {p.gold}\n    return result\n" for p in problems], sandbox=box)
        assert (len(judged), sum(j.correct for j in judged)) == (1319, 1319)
