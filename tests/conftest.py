"""Shared fixtures: the real `slm-bench` console script, the test pipelines, and file-tree snapshots."""
import contextlib
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = ROOT / "tests" / "pipelines"
SLM_BENCH = Path(sys.executable).parent / "slm-bench"


@contextlib.contextmanager
def served_checkpoint(checkpoint, timeout: float = 60):
    "A real `slm-bench serve` of `checkpoint` on a free loopback port: yields its URL; the server stops afterwards."
    proc = subprocess.Popen([str(SLM_BENCH), "serve", str(checkpoint), "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline, line = time.time() + timeout, ""
    while time.time() < deadline and "serving" not in line:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
        if proc.poll() is not None:
            raise RuntimeError(f"slm-bench serve exited: {proc.stderr.read()}")
    try:
        yield line.split(" at ", 1)[1].split(" ;")[0].strip()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def save_wide_checkpoint(folder: Path, texts) -> Path:
    "An untrained tiny Llama with a 1,024-token context (room for a teacher template or a judge rubric), its tokenizer trained on `texts`."
    from slm_bench.lm.models import create_model, get_preset, save_checkpoint
    from slm_bench.lm.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(list(texts), vocab_size=600)
    save_checkpoint(create_model(get_preset("llama-0.5m", vocab_size=len(tokenizer), max_position_embeddings=1024),
                                 pad_token_id=tokenizer.pad_token_id), tokenizer, folder)
    return folder


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


CORPUS = [f"Tom has {a} apples and buys {b} more, so he has {a + b} apples." for a in range(2, 30) for b in range(2, 12)]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    "A tiny Llama trained for a few seconds on an arithmetic corpus (it completes 'Tom has ...' sensibly), saved in HF format."
    from slm_bench.lm.models import create_model, get_preset
    from slm_bench.lm.packing import pack, text_example
    from slm_bench.lm.tokenizer import train_tokenizer
    from slm_bench.train.engine import CausalLM, PackedRows, TrainConfig, Trainer

    out = tmp_path_factory.mktemp("tiny")
    tokenizer = train_tokenizer(CORPUS, vocab_size=320)
    model = create_model(get_preset("llama-0.5m", vocab_size=len(tokenizer), max_position_embeddings=96),
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    rows = pack([text_example(tokenizer, t) for t in CORPUS], seq_len=64, pad_id=tokenizer.pad_token_id)
    config = TrainConfig(steps=120, micro_batch_size=8, lr=3e-3, warmup_steps=10, progress=False)
    Trainer(model, CausalLM(), PackedRows(rows, 8), config, out / "train", tokenizer).train()
    return out / "train" / "final"
