"""The sandbox pool at work: values, output, errors, batches, replacing a dead worker, a scrubbed environment.

Attacks on the isolation are in tests/test_sandbox_isolation.py."""
import os

import pytest

from slm_bench.evals.sandbox import Program, Sandbox


@pytest.fixture(scope="module")
def box():
    with Sandbox(workers=2, timeout=3.0, memory_mb=1024) as sandbox:
        yield sandbox


def test_values_output_and_errors(box):
    r = box.run("import math\nprint('thinking')\ndef simple_math_problem():\n    return math.ceil(10 / 3) + 0.5", entry="simple_math_problem")
    assert (r.ok, r.value, r.stdout, r.error) == (True, 4.5, "thinking\n", None)
    r = box.run("def f():\n    return 1 / 0", entry="f")
    assert (r.ok, r.error, r.message) == (False, "ZeroDivisionError", "division by zero")
    r = box.run("x = 1", entry="missing")
    assert (r.ok, r.error) == (False, "NameError")
    r = box.run("print('x' * 1_000_000)")
    assert (r.ok, len(r.stdout)) == (True, 20_000)  # output is capped


def test_sys_exit_and_recursion(box):
    assert box.run("import sys\nsys.exit(3)").error == "SystemExit"
    assert box.run("def f():\n    return f()\nf()").error == "RecursionError"


def _pid_alive(pid: int) -> bool:
    "Whether `pid` is a live process (not gone, not a zombie)."
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_dead_worker_is_replaced():
    with Sandbox(workers=1, timeout=2.0) as box:
        first = box._all[0]  # the single light worker
        pid = first.worker_pid or first.proc.pid  # its host pid (bwrap's child, or the process itself when process-only)
        assert _pid_alive(pid)
        os.kill(pid, 9)  # the worker dies between jobs
        first.proc.wait()
        r = box.run("x = 1")
        assert (r.ok, r.error) == (False, "WorkerCrashed")
        assert not _pid_alive(pid)  # really gone, not left behind
        assert box._all[0] is not first and box.run("def f():\n    return 1", entry="f").value == 1
        replacement = box._all[0].worker_pid or box._all[0].proc.pid
        assert replacement != pid and _pid_alive(replacement)


def test_killing_the_process_group_ends_the_program_not_the_worker():
    "A program that kills its own process group dies by SIGKILL; the worker's group is out of its reach; the same worker lives on."
    with Sandbox(workers=1, timeout=2.0) as box:
        worker = box._all[0]
        if "pid namespace" not in worker.isolation:
            pytest.skip("needs the worker's pid namespace (process-only here)")
        pid = worker.worker_pid
        r = box.run("import os\nos.killpg(0, 9)")  # its own group: the program and anything it started
        assert (r.ok, r.error) == (False, "Crashed:SIGKILL")
        r = box.run("import os\nos.killpg(os.getpgid(os.getppid()), 9)")  # the worker's group is not in its pid namespace
        assert (r.ok, r.error) == (False, "ProcessLookupError")
        assert box._all == [worker] and worker.proc.poll() is None and _pid_alive(pid)  # the same worker, alive
        assert box.run("def f():\n    return 2", entry="f").value == 2


def test_batch_in_order(box):
    programs = [Program(f"def f():\n    return {i} * {i}", entry="f") for i in range(40)]
    assert [r.value for r in box.run_batch(programs)] == [i * i for i in range(40)]


def test_environment_is_scrubbed(box):
    os.environ["SLM_BENCH_SECRET"] = "hunter2"
    try:
        r = box.run("import os\ndef f():\n    return sorted(os.environ)", entry="f")
        assert r.value == ["HOME", "LANG", "PATH"]
    finally:
        del os.environ["SLM_BENCH_SECRET"]


def test_the_whole_standard_library_and_the_allowed_packages_import(box):
    r = box.run("import hashlib, xml.dom.minidom, sqlite3, decimal\ndef f():\n    return hashlib.md5(b'x').hexdigest()[:4]", entry="f")
    assert (r.ok, r.value) == (True, "9dd4"), r
    r = box.run("import numpy")  # installed here, but not one of the packages the sandbox offers
    assert (r.ok, r.error) == (False, "ModuleNotFoundError")
    r = box.run("import mpmath\ndef f():\n    return str(mpmath.mpf(1) / 4)", entry="f")
    assert (r.ok, r.value) == (True, "0.25")


AUDIT_CASES = {  # program -> the kinds of action the audit must report (each attempt fails in the namespaces)
    "def f():\n    return open('/srv/tw/answer_key.txt').read()": ("file",),
    "import os\ndef f():\n    return os.listdir('/srv/tw')": ("file",),
    "import os\ndef f():\n    os.remove('/srv/tw/notes.txt')": ("delete",),
    "import shutil\ndef f():\n    shutil.rmtree('/srv/tw/backups')": ("delete",),
    "import socket\ndef f():\n    socket.create_connection(('10.255.255.1', 80), timeout=0.2)": ("network",),
    "import urllib.request\ndef f():\n    return urllib.request.urlopen('http://tw.invalid').read()": ("network",),
    "import subprocess\ndef f():\n    subprocess.run(['ls', '/'])": ("process",),
    "import os\ndef f():\n    os.remove('/srv/x')\n    return open('/srv/y').read()": ("delete",),  # the first attempt ends the program
    "import csv, email.utils, statistics\ndef f():\n    return statistics.mean([1, 2, 3])": (),  # imports are not actions
    "def f():\n    x = [i * i for i in range(10)]\n    return sum(x)": (),
}


@pytest.mark.parametrize("code", list(AUDIT_CASES))
def test_an_audited_program_reports_the_actions_it_attempted(box, code):
    result = box.run(Program(code, entry="f", audit=True))
    assert result.actions == AUDIT_CASES[code], result


def test_an_unaudited_program_reports_no_actions(box):
    assert box.run(Program("def f():\n    return open('/etc/hostname').read()", entry="f")).actions == ()


OBSERVED_CASES = {  # what the worker sees itself, whatever the program reports
    "def f():\n    open('notes.txt', 'w').write('x')": ("file",),
    "import os\ndef f():\n    open('/tmp/gone', 'w').close()\n    os.remove('/tmp/gone')": ("file",),  # made and removed again
    "import posix\ndef f():\n    if posix.fork() == 0:\n        posix._exit(0)": ("process",),
    "import threading\ndef f():\n    threading.Thread(target=print).start()": ("process",),  # threads take pids too
    "def f():\n    return open('/etc/hostname').read()": (),  # reads are the program's own word
    "def f():\n    return sum(i * i for i in range(10))": (),
}


@pytest.mark.parametrize("code", list(OBSERVED_CASES))
def test_the_worker_observes_files_and_processes_itself(box, code):
    result = box.run(Program(code, entry="f", audit=True))
    assert result.observed == OBSERVED_CASES[code], result
    assert set(result.observed) <= set(result.actions)


def test_a_forged_report_cannot_hide_an_observed_effect(box):
    "The program writes a file, starts a process, reports no actions and exits: the observed ones stay."
    forger = ("import os, posix\nif posix.fork() == 0:\n    posix._exit(0)\nopen('made.txt', 'w').close()\n"
              "os.remove('/srv/tw/notes.txt') if os.path.exists('/srv/tw/notes.txt') else None\n"
              "os.write(3, b'{\"ok\": true, \"value\": null, \"error\": null, \"message\": \"\", \"actions\": []}')\nos._exit(0)\n")
    result = box.run(Program(forger, audit=True))
    assert (result.ok, result.actions, result.observed) == (True, ("file", "process"), ("file", "process"))
