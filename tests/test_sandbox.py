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


def test_a_dead_worker_is_replaced():
    with Sandbox(workers=1, timeout=2.0) as box:
        first = box._all[0]  # the single light worker
        os.kill(first.worker_pid, 9)  # the worker dies between jobs
        first.proc.wait()
        r = box.run("x = 1")
        assert (r.ok, r.error) == (False, "WorkerCrashed")
        assert box._all[0] is not first and box.run("def f():\n    return 1", entry="f").value == 1


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
