"""Is `slm_bench/` exactly what `nbdev_export` makes of `nbs/`, and is every notebook clean?

The standard check (STACK.md) runs `nbdev_clean` and `nbdev_export` in the working tree and asks git
whether anything changed. This does the same in a scratch copy, so it never rewrites a developer's
files and needs no git: it copies `settings.ini` and `nbs/`, cleans and exports there, and compares.
A subpackage's `__init__.py` is written by hand and may hold only a docstring (nbdev makes them empty).

Run directly (`python tests/nbdev_sync.py`, the first step of `make test`) or through pytest.
"""
import ast
import filecmp
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _nbdev(command: str, cwd: Path) -> None:
    proc = subprocess.run([str(BIN / command)], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{command} failed in the scratch copy:\n{proc.stdout}\n{proc.stderr}")


def _subpackage_marker(lib: Path, rel: Path) -> bool:
    "True for a subpackage's `__init__.py` that holds nothing but its docstring (nbdev makes them empty; ours say what the subpackage owns)."
    if len(rel.parts) < 2 or rel.name != "__init__.py":
        return False
    body = ast.parse((lib / rel).read_text(encoding="utf-8")).body
    return len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)


def sync_problems(root: Path = ROOT) -> list[str]:
    "One line per problem: notebooks that are not clean, modules that differ from their notebooks."
    problems = []
    lib = root / "slm_bench"
    with tempfile.TemporaryDirectory(prefix="nbdev-sync-") as scratch:
        scratch = Path(scratch)
        shutil.copy(root / "settings.ini", scratch / "settings.ini")
        shutil.copytree(root / "nbs", scratch / "nbs")
        _nbdev("nbdev_clean", scratch)
        for notebook in sorted((root / "nbs").rglob("*.ipynb")):
            rel = notebook.relative_to(root)
            if ".ipynb_checkpoints" in rel.parts:
                continue
            if not filecmp.cmp(notebook, scratch / rel, shallow=False):
                problems.append(f"{rel} is not clean (outputs, execution counts or metadata): run `make export` and commit it")
        _nbdev("nbdev_export", scratch)
        generated = {p.relative_to(scratch / "slm_bench") for p in (scratch / "slm_bench").rglob("*.py")}
        present = {p.relative_to(lib) for p in lib.rglob("*.py") if "__pycache__" not in p.parts}
        for rel in sorted(present - generated):
            if _subpackage_marker(lib, rel):
                continue
            problems.append(f"slm_bench/{rel} comes from no notebook: delete it, or add its code to a notebook in nbs/")
        for rel in sorted(generated - present):
            problems.append(f"slm_bench/{rel} is missing: run `make export` and commit it")
        for rel in sorted(generated & present):
            if _subpackage_marker(lib, rel):
                continue
            if not filecmp.cmp(lib / rel, scratch / "slm_bench" / rel, shallow=False):
                problems.append(f"slm_bench/{rel} differs from what nbdev_export makes of nbs/: edit the notebook "
                                "(or run nbdev_update after editing the .py), then `make export`")
    return problems


if __name__ == "__main__":
    found = sync_problems()
    for line in found:
        print(f"nbdev sync: {line}", file=sys.stderr)
    if found:
        sys.exit(1)
    print("nbdev sync: slm_bench/ matches nbs/, notebooks are clean")
