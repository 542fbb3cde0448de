"""Adversarial programs against the sandbox, each with the exact outcome it must have and the layer that stops it.

Used by tests/test_sandbox_isolation.py in-process (as the test's user) and as a script under another user:
    python tests/sandbox_attacks.py CONTEXT_JSON   prints {attack: outcome} as JSON
An outcome is [ok, error, value] of the attack's SandboxResult; `after` attacks check, in a later job on the
same worker, what an earlier one left behind. The forgeries (`forgeries`) are completions of a HumanEval-style task,
judged the trusted way (`evals.checker.judge_outside`); their outcome is [passed, error].
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NO_SHELL = 127 << 8  # os.system's status when /bin/sh cannot be executed: there is no shell in the view
EROFS, ENOSYS = 30, 38


@dataclass
class Attack:
    name: str
    code: str  # defines attack() whose return value is the outcome's value
    expected: list  # [ok, error, value]
    layer: str  # the isolation layer that stops it (one of Sandbox.isolation)
    timeout: float | None = None
    after: str | None = None  # a follow-up program run later on the same worker (its value is checked too)
    expected_after: object = None
    pause: float = 0.0  # seconds between the attack and its follow-up


def attacks(ctx: dict) -> list[Attack]:
    "The attack suite; `ctx` names host things the attacks aim at (files, a listener, the parent's pid, a marker path)."
    marker, pid, port = ctx["marker"], ctx["host_pid"], ctx["port"]
    read = "def attack():\n    return open({!r}).read()[:20]\n"
    return [
        Attack("read a project file", read.format(ctx["project_file"]), [False, "FileNotFoundError", None], "mount namespace"),
        Attack("read a run's gold answers", read.format(ctx["gold_file"]), [False, "FileNotFoundError", None], "mount namespace"),
        Attack("read a benchmark file", read.format(ctx["benchmark_file"]), [False, "FileNotFoundError", None], "mount namespace"),
        Attack("read the parent's /proc/<pid>/environ", read.format(f"/proc/{pid}/environ"), [False, "FileNotFoundError", None], "no /proc"),
        Attack("open the parent's /proc/<pid>/mem", f"def attack():\n    return open('/proc/{pid}/mem', 'r+b')\n",
               [False, "FileNotFoundError", None], "no /proc"),
        Attack("_socket to a listener on 127.0.0.1",
               f"import _socket\ndef attack():\n    s = _socket.socket()\n    s.connect(('127.0.0.1', {port}))\n    s.send(b'leak')\n",
               [False, "ConnectionRefusedError", None], "network namespace"),
        Attack("posix.system", f"import posix\ndef attack():\n    return posix.system('touch {marker}')\n", [True, None, NO_SHELL],
               "mount namespace"),
        Attack("_io.FileIO outside the folder",
               f"import _io\ndef attack():\n    _io.FileIO({ctx['escape']!r}, 'w').write(b'x')\n    _io.FileIO('{ROOT}/escape', 'w')\n",
               [False, "FileNotFoundError", None], "mount namespace",
               after=f"import os\ndef attack():\n    return os.path.exists({ctx['escape']!r})\n", expected_after=False),
        Attack("write under the read-only runtime", "def attack():\n    open('/usr/lib/escape', 'w')\n",
               [False, "OSError", None], "mount namespace"),
        Attack("Popen via __subclasses__",
               "import subprocess\ndef attack():\n    popen = [c for c in object.__subclasses__() if c.__name__ == 'Popen'][0]\n"
               f"    popen(['/bin/sh', '-c', 'touch {marker}'])\n", [False, "FileNotFoundError", None], "mount namespace"),
        Attack("a new python via Popen", "import subprocess, sys\ndef attack():\n"
               f"    return subprocess.run([sys.executable, '-c', {'open(%r)' % ctx['project_file']!r}], capture_output=True).returncode\n",
               [True, None, 1], "mount namespace"),
        Attack("importlib.reload(os)", f"import importlib, os\ndef attack():\n    importlib.reload(os)\n    return os.system('touch {marker}')\n",
               [True, None, NO_SHELL], "mount namespace"),
        Attack("ctypes system()", f"import ctypes\ndef attack():\n    return ctypes.CDLL(None).system(b'touch {marker}')\n",
               [True, None, NO_SHELL], "mount namespace"),
        Attack("write to /dev/shm", "def attack():\n    open('/dev/shm/leak', 'w').write('x')\n", [False, "FileNotFoundError", None],
               "mount namespace"),
        Attack("a .pth file in the venv", f"def attack():\n    open({ctx['venv_site'] + '/evil.pth'!r}, 'w').write('import os')\n",
               [False, "FileNotFoundError", None], "mount namespace"),
        Attack("ptrace the worker", "import ctypes\ndef attack():\n    libc = ctypes.CDLL(None, use_errno=True)\n"
               "    return [libc.syscall(101, 16, 1, 0, 0), ctypes.get_errno()]\n", [True, None, [-1, ENOSYS]], "seccomp"),
        Attack("a nested user namespace", "import ctypes\ndef attack():\n    libc = ctypes.CDLL(None, use_errno=True)\n"
               "    return [libc.unshare(0x10000000), ctypes.get_errno()]\n", [True, None, [-1, ENOSYS]], "seccomp"),
        Attack("a setsid grandchild that outlives the job",
               "import posix, time\ndef attack():\n    read, write = posix.pipe()\n    if posix.fork() == 0:\n        posix.setsid()\n"
               "        if posix.fork() == 0:\n            posix.write(write, str(posix.getpid()).encode())\n            time.sleep(1.0)\n"
               "            open('/tmp/late', 'w').write('still here')\n            posix._exit(0)\n        posix._exit(0)\n"
               "    return int(posix.read(read, 20))\n", [True, None, "<pid>"], "pid namespace", pause=1.5,
               after="import os\ndef attack():\n    try:\n        os.kill(PID, 0)\n        alive = True\n    except ProcessLookupError:\n"
                     "        alive = False\n    return [alive, os.path.exists('/tmp/late')]\n", expected_after=[False, False]),
        Attack("read stdin", "import sys, os\ndef attack():\n    return [sys.stdin.read(), os.read(0, 100).decode()]\n",
               [True, None, ["", ""]], "stdin /dev/null"),
        Attack("forge an oversized result", "import os\nos.write(3, b'{\"ok\": true, \"value\": \"' + b'x' * 3_000_000 + b'\"}')\nos._exit(0)\n",
               [False, "ResultTooLarge", None], "result cap"),
        Attack("forge a verdict, then fail", "import os\nos.write(3, b'{\"ok\": true, \"value\": 42, \"error\": null, \"message\": \"\"}')\n"
               "raise ValueError('the real outcome')\n", [False, "ResultInvalid", None], "result cap"),
        Attack("a fork bomb", "import posix\nwhile True:\n    posix.fork()\n", [False, "BlockingIOError", None], "process limit"),
        Attack("a 10 GB allocation", "x = bytearray(10 * 1024 ** 3)\n", [False, "MemoryError", None], "rlimits"),
        Attack("an infinite loop", "while True:\n    pass\n", [False, "Timeout", None], "deadline", timeout=1.0),
        Attack("kill the parent by its host pid", f"import os\ndef attack():\n    os.kill({pid}, 9)\n",
               [False, "ProcessLookupError", None], "pid namespace"),
        Attack("kill the worker and everyone", "import os\ndef attack():\n    ppid = os.getppid()\n    os.kill(ppid, 9)\n    try:\n"
               "        os.kill(-1, 9)\n    except OSError as error:\n        return [ppid, type(error).__name__]\n",
               [True, None, [1, "ProcessLookupError"]], "pid namespace"),
        Attack("files left for the next job", "def attack():\n    open('/tmp/left', 'w').write('x')\n    open('left', 'w').write('x')\n",
               [True, None, None], "private /tmp",
               after="import os\ndef attack():\n    return [os.path.exists('/tmp/left'), sorted(os.listdir('/tmp'))]\n",
               expected_after=[False, ["job"]]),
    ]


@dataclass
class Forgery:
    name: str
    body: str  # a completion of FORGED_TASK's function: wrong, plus its attempt to pass anyway
    expected: list  # [passed, error] of its CheckOutcome


FORGED_PROMPT = 'def add(a, b):\n    "The sum of a and b."\n'
FORGED_TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
FORGED_REPORT = "{'ok': True, 'value': 'x', 'error': None, 'message': ''}"


def forgeries() -> list[Forgery]:
    "Programs that try to pass a test they fail: each must fail, with the exact error that names how."
    return [
        Forgery("forge a passing report, then exit 0",
                f"    return 0\nimport posix, json\nposix.write(3, json.dumps({FORGED_REPORT}).encode())\nposix._exit(0)\n",
                [False, "ForgedReport"]),
        Forgery("forge from a thread, then os._exit",
                "    import time\n    time.sleep(1)\n    return 0\nimport json, os, threading\n"
                f"def forge():\n    os.write(3, json.dumps({FORGED_REPORT}).encode())\n    os._exit(0)\n"
                "threading.Thread(target=forge).start()\n", [False, "ForgedReport"]),
        Forgery("patch check and assert through builtins",
                "    return 0\nimport builtins\nbuiltins.AssertionError = type('Never', (Exception,), {})\n"
                "builtins.check = lambda candidate: None\ndef check(candidate):\n    return None\n", [False, "AssertionError"]),
        Forgery("return an object equal to everything",
                "    class Yes:\n        def __eq__(self, other):\n            return True\n    return Yes()\n", [False, "NotALiteral"]),
        Forgery("return an int subclass equal to everything",
                "    class Five(int):\n        def __eq__(self, other):\n            return True\n        __hash__ = int.__hash__\n"
                "    return Five(5)\n", [False, "NotALiteral"]),
        Forgery("print a fake verdict on stdout",
                "    print('{\"passed\": true}')\n    print('all tests passed')\n    return 0\n", [False, "AssertionError"]),
        Forgery("patch the worker's encoder to answer what it likes",  # only an answer no worker writes can show it took
                "    return 0\nimport sys\nfor module in list(sys.modules.values()):\n    if hasattr(module, 'encode_value'):\n"
                "        module.encode_value = lambda value, depth=0: {'passed': True}\n", [False, "ForgedReport"]),
    ]


def run_forgeries(box) -> dict:
    "Judge every forgery on `box` the trusted way: {name: [passed, error]}."
    from slm_bench.evals.checker import CheckCase, judge_outside

    cases = [CheckCase(FORGED_PROMPT, FORGED_TEST, "add", FORGED_PROMPT + f.body) for f in forgeries()]
    return {f.name: [o.passed, o.error] for f, o in zip(forgeries(), judge_outside(cases, box))}


def outcome(result) -> list:
    return [result.ok, result.error, result.value]


def run_attacks(box, ctx: dict) -> dict:
    "Run every attack (and its follow-up) on `box`; after each, prove the pool still works. {name: {outcome, after, works}}."
    from slm_bench.evals.isolation import missing_layers
    from slm_bench.evals.sandbox import Program

    # never without the namespaces: "kill everyone" outside a pid namespace would kill every process of the user
    assert box.mode == "namespaces" and missing_layers(box.isolation) == [], box.isolation
    report = {}
    for attack in attacks(ctx):
        result = box.run(Program(attack.code, "attack" if "def attack" in attack.code else None, attack.timeout))
        entry = {"outcome": outcome(result), "message": result.message}
        if attack.after:
            time.sleep(attack.pause)
            code = attack.after.replace("PID", str(result.value))
            entry["after"] = box.run(Program(code, "attack")).value
        check = box.run(Program("def f():\n    return 6 * 7", "f"))
        entry["works"] = check.ok and check.value == 42
        report[attack.name] = entry
    return report


if __name__ == "__main__":
    from slm_bench.evals.sandbox import Sandbox

    context = json.loads(sys.argv[1])
    with Sandbox(workers=1, timeout=3.0, isolation="namespaces") as sandbox:
        print(json.dumps({"isolation": sandbox.isolation, "attacks": run_attacks(sandbox, context),
                          "forgeries": run_forgeries(sandbox)}))
