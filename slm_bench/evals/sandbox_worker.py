"""What runs inside the sandbox: a warm worker that forks one child per program, and the child that runs it. Standard library only."""

from __future__ import annotations

import json
import os
import select
import signal
import stat
import sys
import time

PRELOAD = ("math", "cmath", "sympy", "fractions", "decimal", "numbers", "itertools", "functools", "operator", "collections",
           "collections.abc", "heapq", "bisect", "array", "copy", "string", "re", "statistics", "random", "datetime",
           "calendar", "time", "json", "hashlib", "typing", "dataclasses", "enum", "textwrap", "unicodedata", "struct")
HEAVY_MODULES = ("sympy",)  # only in the "full" workers
FRAME_BYTES = 65536  # the most a child's result report may hold; the worker refuses a longer one
VALUE_CHARS, MESSAGE_CHARS, ITEMS, DEPTH, INT_BITS = 2000, 1000, 100, 8, 4096


def _jsonable(value, depth: int = 0):
    "A JSON-friendly form of a program's return value within the caps (numbers stay numbers; others become their capped repr)."
    import numbers

    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return value[:VALUE_CHARS]
    if isinstance(value, numbers.Integral):
        value = int(value)
        return value if value.bit_length() <= INT_BITS else f"<int of {value.bit_length()} bits>"
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, (list, tuple)) and len(value) <= ITEMS and depth < DEPTH:
        return [_jsonable(v, depth + 1) for v in value]
    sympy = sys.modules.get("sympy")  # sympy numbers are not registered as numbers.Number
    if sympy is not None and isinstance(value, sympy.Basic) and value.is_number:
        try:
            return _jsonable(int(value) if value.is_Integer else float(value), depth)
        except (TypeError, ValueError):
            pass
    try:
        return repr(value)[:VALUE_CHARS]
    except Exception as error:  # a hostile __repr__
        return f"<unprintable {type(value).__name__}: {type(error).__name__}>"


def result_frame(result: dict) -> bytes:
    "The child's report as one JSON object of at most `FRAME_BYTES` (a value too big for it becomes its capped repr)."
    try:
        payload = json.dumps(result, allow_nan=True).encode()
    except (TypeError, ValueError):
        payload = b""
    if not payload or len(payload) > FRAME_BYTES:
        payload = json.dumps({**result, "value": repr(result["value"])[:VALUE_CHARS]}).encode()
    return payload


def _within_caps(value, depth: int = 0) -> bool:
    "Whether `value` is something `_jsonable` could have produced."
    if value is None or isinstance(value, (bool, float)):
        return True
    if isinstance(value, int):
        return value.bit_length() <= INT_BITS
    if isinstance(value, str):
        return len(value) <= VALUE_CHARS
    if isinstance(value, list):
        return len(value) <= ITEMS and depth < DEPTH and all(_within_caps(v, depth + 1) for v in value)
    return False


def parse_frame(frame: bytes) -> dict:
    "The child's result, if `frame` is exactly one report the child's own code could have written; ValueError otherwise."
    if len(frame) > FRAME_BYTES:
        raise ValueError(f"the result report is {len(frame)} bytes, over the {FRAME_BYTES}-byte cap")
    result = json.loads(frame)  # a second report after the first is "Extra data"
    if not isinstance(result, dict) or set(result) != {"ok", "value", "error", "message"}:
        raise ValueError("the result report does not have the fields ok, value, error, message")
    ok, error, message = result["ok"], result["error"], result["message"]
    if not isinstance(ok, bool) or not isinstance(message, str) or len(message) > MESSAGE_CHARS:
        raise ValueError("the result report's ok or message is malformed")
    if (error is not None) == ok or (error is not None and (not isinstance(error, str) or len(error) > 100)):
        raise ValueError("the result report's error does not match its ok")
    if not _within_caps(result["value"]):
        raise ValueError("the result report's value is over the caps")
    return result


RESULT_FD = 3  # the child's only descriptor besides stdin (/dev/null), stdout and stderr (its captured output)


def _execute(job: dict) -> dict:
    "Run the program (and its entry function) in a fresh namespace; the report of how it went."
    result = {"ok": False, "value": None, "error": None, "message": ""}
    try:
        namespace = {"__name__": "__sandbox__", "__builtins__": __builtins__}
        exec(compile(job["code"], "<program>", "exec"), namespace)
        if job.get("entry"):
            if not callable(namespace.get(job["entry"])):
                raise NameError(f"the program defines no function {job['entry']!r}")
            result["value"] = _jsonable(namespace[job["entry"]]())
        result["ok"] = True
    except BaseException as error:  # SystemExit and KeyboardInterrupt are program failures too
        result["error"] = type(error).__name__[:100]
        try:
            result["message"] = str(error)[:MESSAGE_CHARS]
        except Exception:
            result["message"] = "<the exception's message could not be printed>"
    return result


def _run_child(job: dict, result_fd: int, output_fd: int) -> None:
    "The forked child: its own session and folder, stdin from /dev/null, no other descriptors, a CPU limit; run, report, exit."
    import resource

    me = os.getpid()
    os.setsid()
    os.chdir(job["folder"])
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(output_fd, 1)
    os.dup2(output_fd, 2)
    os.dup2(result_fd, RESULT_FD)
    os.closerange(RESULT_FD + 1, 1 << 20)
    resource.setrlimit(resource.RLIMIT_CPU, (int(job["timeout"]) + 1,) * 2)
    os.environ.clear()
    os.environ.update({"PATH": "/usr/bin:/bin", "HOME": job["folder"], "LANG": "C.UTF-8"})
    result = _execute(job)
    if os.getpid() != me:  # a process the program forked finished the program's code: it reports nothing
        os._exit(0)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os.write(RESULT_FD, result_frame(result))
    os._exit(0)


def _drain(read_end: int, frame: bytearray) -> None:
    "Add what is waiting in the pipe to `frame`, up to one byte past the cap, without blocking."
    os.set_blocking(read_end, False)
    try:
        while len(frame) <= FRAME_BYTES:
            chunk = os.read(read_end, FRAME_BYTES + 1 - len(frame))
            if not chunk:
                return
            frame += chunk
    except BlockingIOError:
        pass


def _collect(pid: int, read_end: int, deadline: float) -> tuple[bytes, str | None]:
    """Read the child's report until the child exits, the deadline passes or the report outgrows `FRAME_BYTES`.

    Returns the bytes read and why reading stopped early ("Timeout", "ResultTooLarge"), or None when the child exited."""
    pidfd = os.pidfd_open(pid)
    frame, watching = bytearray(), [read_end, pidfd]
    try:
        while len(frame) <= FRAME_BYTES:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return bytes(frame), "Timeout"
            ready, _, _ = select.select(watching, [], [], remaining)
            if pidfd in ready:  # the child exited: what it wrote is in the pipe now
                _drain(read_end, frame)
                break
            if read_end in ready:
                chunk = os.read(read_end, FRAME_BYTES + 1 - len(frame))
                if not chunk:
                    watching = [pidfd]  # every writer closed its end: wait for the exit alone
                frame += chunk
        return bytes(frame), ("ResultTooLarge" if len(frame) > FRAME_BYTES else None)
    finally:
        os.close(pidfd)


def _end_job(pid: int, in_namespace: bool) -> int:
    """Kill the child and everything it started; reap them; the child's wait status.

    In the worker's own pid namespace the worker is pid 1: `kill(-1)` reaches every other process in it, including
    descendants that left the child's session. Outside one (process-only), only the child's process group is reachable."""
    status = None
    while True:
        try:
            if in_namespace:
                os.kill(-1, signal.SIGKILL)
            else:
                os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            done, wait_status = os.waitpid(-1 if in_namespace else pid, 0)
        except ChildProcessError:
            return status if status is not None else 0
        if done == pid:
            status = wait_status
            if not in_namespace:
                return status


def _signal_name(status: int) -> str:
    return signal.Signals(os.WTERMSIG(status)).name


def verdict(job: dict, frame: bytes, stopped: str | None, status: int) -> dict:
    """The job's outcome, decided by the worker: the child's report only when it is the one report the child's own
    code writes, and the child then exited normally; otherwise why there is none (a timeout, a crash, a forged report)."""
    if stopped == "Timeout":
        return {"ok": False, "value": None, "error": "Timeout", "message": f"ran longer than {job['timeout']:g} s"}
    if stopped == "ResultTooLarge":
        return {"ok": False, "value": None, "error": "ResultTooLarge",
                "message": f"more than {FRAME_BYTES} bytes were written to the result descriptor"}
    exited_normally = os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    if frame:
        try:
            result = parse_frame(frame)
            if not exited_normally:
                raise ValueError(f"a report was written but the child then ended with wait status {status}")
            return result
        except ValueError as error:
            return {"ok": False, "value": None, "error": "ResultInvalid", "message": str(error)[:MESSAGE_CHARS]}
    if os.WIFSIGNALED(status):
        name = _signal_name(status)
        message = {"SIGXCPU": "CPU time limit exceeded", "SIGSEGV": "crashed (segmentation fault, e.g. a C stack overflow)",
                   "SIGKILL": "killed (out of memory or a limit)"}.get(name, name)
        return {"ok": False, "value": None, "error": f"Crashed:{name}", "message": message}
    return {"ok": False, "value": None, "error": "Crashed",
            "message": f"exited with status {os.waitstatus_to_exitcode(status)} without a result"}


def wipe(path: str, keep_root: bool = False) -> None:
    "Remove everything under `path` (and `path` itself unless `keep_root`) whatever modes the program left; links are not followed."
    stack, folders = [path], []
    while stack:
        current = stack.pop()
        try:
            info = os.lstat(current)
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(info.st_mode):
            if current != path or not keep_root:  # a kept root may belong to someone else (root's /tmp, mode 1777)
                os.chmod(current, 0o700)
            folders.append(current)
            stack.extend(os.path.join(current, name) for name in os.listdir(current))
        else:
            os.unlink(current)
    for folder in reversed(folders):  # children before their parents
        if folder != path or not keep_root:
            os.rmdir(folder)


def _run_job(job: dict, scratch: str, in_namespace: bool) -> dict:
    "Fork a child for one job, collect its report within the deadline, kill everything it started, clean its files."
    start = time.perf_counter()
    folder = os.path.join(scratch, "job")
    os.mkdir(folder, 0o700)
    output_fd = os.memfd_create("output")
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            _run_child({**job, "folder": folder}, write_end, output_fd)
        finally:
            os._exit(1)
    os.close(write_end)
    try:
        frame, stopped = _collect(pid, read_end, start + job["timeout"])
    finally:
        status = _end_job(pid, in_namespace)
        os.close(read_end)
    output = os.pread(output_fd, job["output_bytes"], 0).decode("utf-8", "replace")
    os.close(output_fd)
    wipe(scratch, keep_root=True) if in_namespace else wipe(folder)
    return {**verdict(job, frame, stopped, status), "stdout": output, "duration_s": time.perf_counter() - start}


HOSTNAME = "slm-sandbox"  # the worker's host name in its own uts namespace
_PR_GET_DUMPABLE, _PR_SET_DUMPABLE, _PR_GET_SECCOMP, _PR_GET_NO_NEW_PRIVS = 3, 4, 21, 39


def _set_limits(settings: dict, in_namespace: bool) -> None:
    """Limits set once in the worker and inherited by every child: address space, file size, open files, no core dumps and,
    inside the worker's own user namespace, processes (counted per user per user namespace, so the user's other processes
    do not count). CPU time is set per child."""
    import resource

    limits = [(resource.RLIMIT_AS, settings["memory_mb"] * 2**20), (resource.RLIMIT_FSIZE, settings["file_bytes"]),
              (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)]
    if in_namespace:
        limits.append((resource.RLIMIT_NPROC, settings["max_processes"]))
    for kind, value in limits:
        resource.setrlimit(kind, (value, value))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an over-long file fails the write instead of killing the child
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as pid 1, signals left at their default are not delivered from inside


def _capabilities(libc) -> int:
    "This process's effective and permitted capability bits (capget), or -1 if they cannot be read."
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    header, data = Header(0x20080522, 0), (Data * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        return -1
    return sum((d.effective | d.permitted) << (32 * i) for i, d in enumerate(data))


def observe_layers(settings: dict, in_namespace: bool) -> list[str]:
    "The isolation layers this worker can see from inside (each one checked here, not assumed)."
    import ctypes
    import resource
    import socket

    libc = ctypes.CDLL(None, use_errno=True)
    seen = [] if in_namespace else ["process-only"]
    seen += ["separate process", "fork per program"]
    checks = {
        "user namespace": settings.get("user_namespace", False) and os.getuid() == settings["sandbox_uid"] != settings["host_uid"],
        "unprivileged uid": os.getuid() == settings.get("sandbox_uid") != 0,
        "no capabilities": _capabilities(libc) == 0,
        "mount namespace": bool(settings.get("host_paths")) and not any(os.path.exists(p) for p in settings["host_paths"]),
        "no /proc": not os.path.exists("/proc/self"),
        "private /tmp": in_namespace and os.statvfs("/tmp").f_blocks * os.statvfs("/tmp").f_frsize == settings.get("tmp_bytes"),
        "pid namespace": in_namespace,
        "network namespace": [name for _, name in socket.if_nameindex()] == ["lo"],
        "uts namespace": socket.gethostname() == HOSTNAME,
        "no new privileges": libc.prctl(_PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) == 1,
        "seccomp": libc.prctl(_PR_GET_SECCOMP, 0, 0, 0, 0) == 2,
        "not dumpable": libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) == 0,
        "rlimits": resource.getrlimit(resource.RLIMIT_AS)[0] == settings["memory_mb"] * 2**20,
        "process limit": in_namespace and resource.getrlimit(resource.RLIMIT_NPROC)[0] == settings["max_processes"],
    }
    seen += [name for name, held in checks.items() if held]
    seen += [name for name in settings.get("unverifiable", []) if in_namespace]  # requested, with no check from inside
    return seen + ["deadline", "stdin /dev/null", "result cap"]


def _warm_sympy() -> None:
    "Run the sympy calls grade-school programs make, so its lazily imported submodules are loaded before forking."
    try:
        import sympy
        x, y = sympy.symbols("x y")
        sympy.solve([sympy.Eq(2 * x + y, 10), sympy.Eq(x - y, 2)], [x, y])
        sympy.solve(x ** 2 - 4, x)
        sympy.simplify(sympy.Rational(3, 4) * x + sympy.sqrt(8))
        sympy.nsimplify(0.25)
        sympy.factorint(360)
        sympy.Symbol("z", positive=True)
    except Exception:
        pass


def _send(fd: int, message: dict) -> None:
    "Write one JSON line to the protocol descriptor, completely."
    data = memoryview((json.dumps(message) + "\n").encode())
    while data:
        data = data[os.write(fd, data):]


def worker_main(kind: str = "full", settings: str = "{}") -> None:
    """The worker's loop: preload, limit, say which layers it sees, then one JSON job per line in, one JSON answer per line out.

    Started by `Sandbox` inside its namespaces (where it is pid 1) or, in process-only mode, as a plain process."""
    import ctypes
    import gc
    import importlib
    import tempfile

    settings = json.loads(settings)
    in_namespace = os.getpid() == 1
    if in_namespace and os.getuid() == 0:  # started by root: become the worker's own uid (this drops every capability)
        os.setgroups([])
        os.setgid(settings["sandbox_uid"])
        os.setuid(settings["sandbox_uid"])
    jobs, protocol = os.fdopen(os.dup(0), "r"), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)  # a stray print can never corrupt the protocol
    os.close(null)
    for name in PRELOAD:
        if kind == "light" and name in HEAVY_MODULES:
            continue
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    if kind == "full":
        _warm_sympy()
    _set_limits(settings, in_namespace)
    ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)  # no ptrace of the worker, even by the same user
    scratch = "/tmp" if in_namespace else tempfile.mkdtemp(prefix="slm-sandbox-")
    _send(protocol, {"ready": True, "isolation": observe_layers(settings, in_namespace)})
    gc.freeze()  # keep the warm heap shared with forked children
    try:
        for line in jobs:
            job = json.loads(line)
            _send(protocol, {"id": job["id"], **_run_job(job, scratch, in_namespace)})
    finally:
        if not in_namespace:
            wipe(scratch)
