"""The sandbox against hostile and broken programs: each fails, the parent survives, nothing outside the temp dir changes."""
import os
import socket
import threading
import time
import uuid

import pytest

from slm_bench.evals.sandbox import Program, Sandbox


@pytest.fixture(scope="module")
def box():
    with Sandbox(workers=2, timeout=3.0, memory_mb=1024) as sandbox:
        yield sandbox


def survives(box):
    "The pool still works after an attack."
    result = box.run("def f():\n    return 6 * 7", entry="f")
    assert result.ok and result.value == 42, result


def test_values_output_and_errors(box):
    r = box.run("import math\nprint('thinking')\ndef simple_math_problem():\n    return math.ceil(10 / 3) + 0.5", entry="simple_math_problem")
    assert r.ok and r.value == 4.5 and r.stdout == "thinking\n" and r.error is None
    r = box.run("def f():\n    return 1 / 0", entry="f")
    assert not r.ok and r.error == "ZeroDivisionError" and "division by zero" in r.message
    r = box.run("x = 1", entry="missing")
    assert not r.ok and r.error == "NameError"
    r = box.run("print('x' * 1_000_000)")
    assert r.ok and len(r.stdout) == 20_000  # output is capped


def test_infinite_loop(box):
    start = time.perf_counter()
    r = box.run("while True:\n    pass", timeout=1.0)
    assert not r.ok and r.error == "Timeout" and time.perf_counter() - start < 5
    survives(box)


def test_fork_bomb(box):
    r = box.run("import os\nwhile True:\n    os.fork()")
    assert not r.ok and r.error in ("PermissionError", "BlockingIOError", "Timeout")
    survives(box)


def test_ten_gigabyte_allocation(box):
    r = box.run("x = bytearray(10 * 1024 ** 3)")
    assert not r.ok and (r.error == "MemoryError" or r.error.startswith("Crashed")), r
    survives(box)


def test_writing_and_deleting_outside(box, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "inner.txt").write_text("also precious")
    escape = f"/tmp/slm-sandbox-escape-{uuid.uuid4().hex}"
    attacks = [
        f"open({str(victim)!r}, 'w').write('gone')",
        f"import os\nos.remove({str(victim)!r})",
        f"import shutil\nshutil.rmtree({str(folder)!r})",
        f"open({escape!r}, 'w').write('escaped')",
        f"import os\nfd = os.open({escape!r}, os.O_WRONLY | os.O_CREAT)\nos.write(fd, b'x')",
        f"import os\nos.rename({str(victim)!r}, 'stolen.txt')",
        "import ctypes\nctypes.CDLL(None).unlink(b'/tmp/x')",
    ]
    for code in attacks:
        r = box.run(code)
        assert not r.ok and r.error in ("PermissionError", "ImportError", "ModuleNotFoundError", "FileNotFoundError"), (code, r)
    assert victim.read_text() == "precious" and (folder / "inner.txt").read_text() == "also precious"
    assert not os.path.exists(escape)
    inside = box.run("open('scratch.txt', 'w').write('fine')\nimport os\nos.remove('scratch.txt')\ndef f():\n    return os.listdir('.')", entry="f")
    assert inside.ok and inside.value == [".output"], inside  # its own temp folder is writable
    survives(box)


def test_os_system_and_subprocess(box, tmp_path):
    marker = tmp_path / "ran"
    for code in (f"import os\nos.system('touch {marker}')", f"import subprocess\nsubprocess.run(['touch', '{marker}'])",
                 f"import os\nos.execv('/usr/bin/touch', ['touch', '{marker}'])"):
        r = box.run(code)
        assert not r.ok and r.error == "PermissionError", (code, r)
    assert not marker.exists()
    survives(box)


def test_network_is_unreachable(box):
    received = []
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
                received.append(conn.recv(100))
                conn.close()
            except OSError:
                pass
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        r = box.run(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\ns.sendall(b'leak')")
        # unreachable network namespace, a socket guard, or (as nobody) no socket module at all
        assert not r.ok and r.error in ("OSError", "ConnectionRefusedError", "PermissionError", "TimeoutError", "ModuleNotFoundError"), r
        time.sleep(0.5)
        assert received == []
    finally:
        stop.set()
        thread.join(timeout=2)
        listener.close()
    survives(box)


def test_sys_exit_recursion_and_killing_the_parent(box):
    r = box.run("import sys\nsys.exit(3)")
    assert not r.ok and r.error == "SystemExit"
    r = box.run("def f():\n    return f()\nf()")
    assert not r.ok and r.error == "RecursionError"
    r = box.run("import sys\nsys.setrecursionlimit(10**7)\ndef f(n):\n    return f(n + 1)\nf(0)", timeout=2.0)
    assert not r.ok and (r.error.startswith("Crashed") or r.error in ("RecursionError", "MemoryError", "Timeout")), r
    r = box.run("import os\nos.kill(os.getppid(), 9)")
    assert not r.ok and r.error == "PermissionError"
    r = box.run("import signal, os\nsignal.pthread_kill(threading.main_thread().ident, 9) if False else os.killpg(os.getpgid(os.getppid()), 9)")
    assert not r.ok
    survives(box)
    assert all(z.proc.poll() is None for z in box._all)  # no worker was lost


def test_a_dead_worker_is_replaced():
    with Sandbox(workers=1, timeout=2.0) as box:
        first = box._all[0]  # the single light worker
        first.proc.kill()  # the worker dies between jobs
        first.proc.wait()
        r = box.run("x = 1")
        assert not r.ok and r.error == "WorkerCrashed"
        assert box._all[0] is not first and box.run("def f():\n    return 1", entry="f").value == 1


def test_batch_in_order(box):
    programs = [Program(f"def f():\n    return {i} * {i}", entry="f") for i in range(40)]
    results = box.run_batch(programs)
    assert [r.value for r in results] == [i * i for i in range(40)]


def test_environment_is_scrubbed(box):
    os.environ["SLM_BENCH_SECRET"] = "hunter2"
    try:
        r = box.run("import os\ndef f():\n    return sorted(os.environ)", entry="f")
        assert r.ok and "SLM_BENCH_SECRET" not in r.value and set(r.value) <= {"PATH", "HOME", "LANG"}
    finally:
        del os.environ["SLM_BENCH_SECRET"]


def test_imports_the_worker_did_not_preload_fail_clearly(box):
    r = box.run("import hashlib, heapq, datetime, typing\ndef f():\n    return hashlib.md5(b'x').hexdigest()[:4]", entry="f")
    assert r.ok and r.value == "9dd4", r
    if "runs as nobody" in box.isolation:
        r = box.run("import xml.dom.minidom")
        assert not r.ok and r.error == "ModuleNotFoundError" and "not available in the sandbox" in r.message
