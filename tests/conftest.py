"""Shared fixtures: the real `slm-bench` console script, the test pipelines, and file-tree snapshots."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = ROOT / "tests" / "pipelines"
SLM_BENCH = Path(sys.executable).parent / "slm-bench"


class CliResult:
    def __init__(self, proc: subprocess.CompletedProcess):
        self.returncode, self.stdout, self.stderr = proc.returncode, proc.stdout, proc.stderr

    def __repr__(self):
        return f"exit {self.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


@pytest.fixture
def cli():
    "Run the installed `slm-bench` console script in a subprocess, as a user would."

    def run(*args, cwd=ROOT, env=None, timeout=300):
        assert SLM_BENCH.exists(), f"{SLM_BENCH} is missing: install the package (make setup)"
        proc = subprocess.run([str(SLM_BENCH), *map(str, args)], cwd=cwd, capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, **(env or {})})
        return CliResult(proc)

    return run


def tree(folder: Path) -> dict[str, int]:
    "Every file and folder under `folder` with its size (folders: -1): a snapshot to prove nothing was written."
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): (p.stat().st_size if p.is_file() else -1) for p in sorted(folder.rglob("*"))}
