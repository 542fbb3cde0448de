"""The sandbox's walls, from the kernel: namespaces set up by bubblewrap, a read-only view of the Python runtime, and a seccomp filter."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
import sys
import sysconfig

from ..core.errors import SlmBenchError
from . import sandbox_worker

MODES = ("namespaces", "process-only")
MODE_VARIABLE = "SLM_BENCH_SANDBOX_ISOLATION"  # how a whole run opts into process-only (explicitly, and its reports say so)
SANDBOX_DIR = "/opt/slm-sandbox"  # where the worker module and the allowed packages appear inside
SITE_DIR = f"{SANDBOX_DIR}/site"
REQUIRED = ("unprivileged uid", "no capabilities", "mount namespace", "no /proc", "private /tmp", "pid namespace",
            "network namespace", "no new privileges", "not dumpable", "process limit")


class IsolationUnavailable(SlmBenchError):
    "The kernel (or the machine) does not offer an isolation layer the sandbox needs; exit code 3."
    exit_code = 3


def isolation_mode(requested: str | None = None) -> str:
    "The mode asked for: `requested`, else `$SLM_BENCH_SANDBOX_ISOLATION`, else namespaces."
    mode = requested or os.environ.get(MODE_VARIABLE) or "namespaces"
    if mode not in MODES:
        raise ValueError(f"unknown sandbox isolation {mode!r}: choose one of {', '.join(MODES)}")
    return mode


# Classic BPF, as seccomp runs it: (code, jump if true, jump if false, constant).
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
ALLOW, ERRNO, KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
ENOSYS = 38  # what a denied call returns: "not implemented here" (no other layer answers ptrace or unshare with it)
AUDIT_ARCH_X86_64 = 0xC000003E
CLONE_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
TIOCSTI = 0x5412
SYSCALLS = {"ioctl": 16, "clone": 56, "ptrace": 101, "syslog": 103, "pivot_root": 155, "mount": 165, "umount2": 166,
            "init_module": 175, "delete_module": 176, "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250,
            "unshare": 272, "perf_event_open": 298, "name_to_handle_at": 303, "open_by_handle_at": 304, "setns": 308,
            "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "finit_module": 313, "kexec_file_load": 320,
            "bpf": 321, "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
            "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
            "clone3": 435, "mount_setattr": 442}  # x86_64 numbers
DENIED = tuple(name for name in SYSCALLS if name not in ("ioctl", "clone", "clone3"))


def seccomp_program(denied=DENIED) -> list[tuple[int, int, int, int]]:
    """The filter as instructions: other architectures are killed (no 32-bit or x32 detour), the `denied` calls and
    clone with a namespace flag fail with ENOSYS, so does clone3 (glibc then falls back to clone, whose flags are
    visible), and so does the TIOCSTI ioctl (typing into a terminal); everything else is allowed."""
    deny = (_RET, 0, 0, ERRNO | ENOSYS)
    program = [(_LD_ABS, 0, 0, 4), (_JEQ, 1, 0, AUDIT_ARCH_X86_64), (_RET, 0, 0, KILL_PROCESS),
               (_LD_ABS, 0, 0, 0), (_JGE, 0, 1, 0x40000000), deny]
    for name in denied:
        program += [(_JEQ, 0, 1, SYSCALLS[name]), deny]
    for name, argument, test, value in (("clone", 0, _JSET, CLONE_NAMESPACES), ("ioctl", 1, _JEQ, TIOCSTI)):
        program += [(_JEQ, 0, 4, SYSCALLS[name]), (_LD_ABS, 0, 0, 16 + 8 * argument), (test, 0, 1, value), deny, (_RET, 0, 0, ALLOW)]
    return program + [(_JEQ, 0, 1, SYSCALLS["clone3"]), deny, (_RET, 0, 0, ALLOW)]


def seccomp_filter(denied=DENIED) -> bytes:
    "The filter as the kernel (and `bwrap --seccomp`) reads it: 8 bytes per instruction."
    return b"".join(struct.pack("<HBBI", *instruction) for instruction in seccomp_program(denied))


def run_seccomp(program, nr: int, args=(), arch: int = AUDIT_ARCH_X86_64) -> int:
    "What `program` answers for one system call, computed the way the kernel's BPF interpreter would (for checking the filter)."
    data = struct.pack("<iIQ6Q", nr, arch, 0, *(list(args) + [0] * 6)[:6])
    accumulator, pc = 0, 0
    while True:
        code, true_jump, false_jump, k = program[pc]
        if code == _RET:
            return k
        if code == _LD_ABS:
            accumulator, pc = struct.unpack_from("<I", data, k)[0], pc + 1
            continue
        taken = {_JEQ: accumulator == k, _JGE: accumulator >= k, _JSET: bool(accumulator & k)}[code]
        pc += 1 + (true_jump if taken else false_jump)


def seccomp_supported() -> bool:
    "The filter's system call numbers are x86_64's; elsewhere the sandbox runs without this layer (and says so)."
    return os.uname().machine == "x86_64"


def _under(path: str, roots) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def runtime_view(packages=("sympy", "mpmath")) -> list[tuple[str, str, str]]:
    """What a program sees, as (how, source, target) mounts: the system's shared libraries and the Python runtime,
    read-only at their own paths (site-packages hidden), the worker module and each allowed package under
    `SANDBOX_DIR`. Nothing else of the host: no project, runs, data, home, /etc or /proc."""
    view = []
    for path in ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32"):
        if os.path.islink(path):
            view.append(("symlink", os.readlink(path), path))
        elif os.path.isdir(path):
            view.append(("ro-bind", path, path))
    executable, stdlib = os.path.realpath(sys.executable), os.path.realpath(sysconfig.get_paths()["stdlib"])
    libpython = os.path.join(sysconfig.get_config_var("LIBDIR") or "", sysconfig.get_config_var("INSTSONAME") or "")
    for path in (executable, stdlib, os.path.realpath(libpython) if os.path.isfile(libpython) else None):
        if path and not _under(path, [target for how, _, target in view if how == "ro-bind"]):
            view.append(("ro-bind", path, path))
    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}
    for site in {os.path.realpath(sysconfig.get_paths(vars=base)[key]) for key in ("purelib", "platlib")} | {"/usr/lib/python3/dist-packages"}:
        if os.path.isdir(site) and _under(site, [target for how, _, target in view if how == "ro-bind"]):
            view.append(("hide", "", site))
    view.append(("ro-bind", os.path.realpath(sandbox_worker.__file__), f"{SANDBOX_DIR}/sandbox_worker.py"))
    return view + _package_mounts(packages)


def _package_mounts(packages) -> list[tuple[str, str, str]]:
    "Read-only mounts of each allowed package (and its bundled `<name>.libs`) under `SITE_DIR`."
    mounts = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not (spec.origin or spec.submodule_search_locations):
            raise ValueError(f"the sandbox cannot offer package {name!r}: it is not installed in this Python ({sys.executable})")
        source = list(spec.submodule_search_locations)[0] if spec.submodule_search_locations else spec.origin
        mounts.append(("ro-bind", os.path.realpath(source), f"{SITE_DIR}/{os.path.basename(source)}"))
        libs = os.path.join(os.path.dirname(source), f"{name}.libs")
        if os.path.isdir(libs):
            mounts.append(("ro-bind", os.path.realpath(libs), f"{SITE_DIR}/{name}.libs"))
    return mounts


def _view_args(view) -> list[str]:
    "bwrap arguments for the view, its folders made first, readable by anyone (bwrap would make them 0700 for root)."
    def ancestors(path: str) -> list[str]:
        parts = path.strip("/").split("/")
        return ["/" + "/".join(parts[:i]) for i in range(1, len(parts))]

    folders = {folder for how, _, target in view if how != "hide" for folder in ancestors(target)} | {"/dev"}
    args = [arg for folder in sorted(folders, key=lambda f: (f.count("/"), f)) for arg in ("--perms", "0755", "--dir", folder)]
    for how, source, target in view:
        args += {"symlink": ["--symlink", source, target], "ro-bind": ["--ro-bind", source, target],
                 "hide": ["--tmpfs", target, "--remount-ro", target]}[how]
    return args


def _host_probes(view) -> list[str]:
    "Host paths that must not exist inside (the project's package, the working folder, home), skipping any the view needs."
    targets = [target for _, _, target in view] + ["/tmp", "/dev", SANDBOX_DIR]  # what exists inside anyway
    candidates = [os.path.dirname(os.path.dirname(os.path.realpath(__file__))), os.getcwd(), os.path.expanduser("~"), sys.prefix]
    return [path for path in dict.fromkeys(os.path.realpath(c) for c in candidates)
            if os.path.exists(path) and path != "/" and not _under(path, targets) and not any(_under(t, [path]) for t in targets)]


def worker_settings(limits: dict, view, tmp_bytes: int) -> dict:
    """What the worker needs to set its limits and to check its layers from inside.

    A normal user's worker runs in a user namespace as uid 1000 (mapped to the user). Root's worker needs no user
    namespace: bwrap runs privileged and the worker drops to a fresh uid of its own, unknown to the host and without
    capabilities; the kernel never limits processes of host uid 0, so a uid of its own is also what makes the
    process limit real (and private to the worker)."""
    import secrets

    host_uid = os.getuid()
    own_uid = 1_900_000_000 + secrets.randbelow(100_000_000) if host_uid == 0 else (1000 if host_uid != 1000 else 1001)
    return {**limits, "tmp_bytes": tmp_bytes, "host_uid": host_uid, "sandbox_uid": own_uid, "user_namespace": host_uid != 0,
            "host_paths": _host_probes(view), "unverifiable": ["ipc namespace"]}


def _worker_code(kind: str, settings: dict, path: list[str]) -> str:
    return (f"import sys; sys.path[:0] = {path!r}; from sandbox_worker import worker_main; "
            f"worker_main({kind!r}, {json.dumps(settings)!r})")


def bwrap_command(bwrap: str, kind: str, settings: dict, view, seccomp_fd: int | None) -> list[str]:
    "The command that starts one worker in fresh mount, pid, network, ipc and uts namespaces (and a user one), as pid 1."
    uid = str(settings["sandbox_uid"])
    if settings["user_namespace"]:
        user = ["--unshare-user", "--disable-userns", "--uid", uid, "--gid", uid]
    else:  # root: the worker switches to its own uid itself, with the two capabilities that takes, then has none
        user = ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    return [bwrap, *user, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--new-session", "--as-pid-1", "--clearenv", "--hostname", sandbox_worker.HOSTNAME, *_view_args(view),
            "--dev-bind", "/dev/null", "/dev/null", "--dev-bind", "/dev/zero", "/dev/zero", "--dev-bind", "/dev/urandom", "/dev/urandom",
            "--perms", "1777", "--size", str(settings["tmp_bytes"]), "--tmpfs", "/tmp", "--chdir", "/tmp",
            *(["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else []),
            "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--setenv", "OMP_NUM_THREADS", "1",
            "--", os.path.realpath(sys.executable), "-I", "-S", "-B", "-c", _worker_code(kind, settings, [SANDBOX_DIR, SITE_DIR])]


def process_only_command(kind: str, settings: dict) -> list[str]:
    "The command that starts one worker as a plain process of this user (no kernel isolation)."
    return [sys.executable, "-I", "-B", "-c", _worker_code(kind, settings, [os.path.dirname(os.path.realpath(sandbox_worker.__file__))])]


OPT_OUT = ("or, to run programs without kernel isolation, opt in explicitly with Sandbox(isolation='process-only') "
            f"or {MODE_VARIABLE}=process-only (every report of the run then says so)")


def find_bwrap() -> str:
    "The bubblewrap executable, or an error that says how to get it."
    path = shutil.which("bwrap")
    if path is None:
        raise IsolationUnavailable("the sandbox needs namespaces (user, mount, pid, network) and sets them up with bubblewrap, "
                                   "which is not installed: `apt install bubblewrap` (Debian/Ubuntu) or `dnf install bubblewrap`; "
                                   + OPT_OUT)
    return path


def explain_start_failure(stderr: str) -> IsolationUnavailable:
    "The error for a worker that could not start, naming the layer the kernel refused."
    said = stderr.strip().splitlines()[-1] if stderr.strip() else "(nothing on stderr)"
    if "namespace" in said.lower() or "uid map" in said.lower() or "max_user_namespaces" in stderr:
        return IsolationUnavailable(f"the kernel refused the sandbox a user namespace (bwrap: {said}); unprivileged user "
                                    "namespaces must be enabled (sysctl user.max_user_namespaces > 0; on Ubuntu also "
                                    "kernel.apparmor_restrict_unprivileged_userns=0); " + OPT_OUT)
    return IsolationUnavailable(f"the sandbox's worker did not start (bwrap or python said: {said}); " + OPT_OUT)


def missing_layers(seen) -> list[str]:
    "The required layers a worker did not see from inside."
    return [layer for layer in REQUIRED if layer not in seen]
