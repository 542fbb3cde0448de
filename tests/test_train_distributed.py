"""Data parallelism: 2 processes × 1 micro-batch equals 1 process × 2 accumulated micro-batches, bit for bit.

The engine runs under `accelerate launch --multi_gpu` unchanged: here on CPU (gloo), on a GPU node
with NCCL through the same accelerate code path; each process takes its share of every optimizer
step's micro-batches.
"""
import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

SCRIPT = Path(__file__).parent / "scripts" / "train_data_parallel.py"


def test_two_processes_equal_accumulation(tmp_path):
    single = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "single"), "2"], capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-2000:]
    launcher = Path(sys.executable).parent / "accelerate"
    multi = subprocess.run([str(launcher), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                            "--mixed_precision", "no", "--dynamo_backend", "no", str(SCRIPT), str(tmp_path / "multi"), "1"],
                           capture_output=True, text=True, timeout=300)
    assert multi.returncode == 0, multi.stderr[-2000:]
    assert "rank 0 of 2 done" in multi.stdout and "rank 1 of 2 done" in multi.stdout
    a = load_file(tmp_path / "single" / "final" / "model.safetensors")
    b = load_file(tmp_path / "multi" / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    losses = lambda run: [json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    assert losses("single") == losses("multi") and len(losses("multi")) == 3  # only the main process logs
