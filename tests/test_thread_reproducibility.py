"""A stage's training does not depend on how many threads it had: under `slm-bench run --jobs N` a stage's share of
the cores changes as other stages start and end, at moments that depend on timing."""
import json
import os
import subprocess
import sys

import pytest

from slm_bench.core.config import PROFILES, engine_environment, engine_settings
from slm_bench.pipeline.schedule import available_cores

# Six steps of the training engine on a tiny Llama, once on one thread and once switching between one and two threads
# step by step as a stage's share can; prints whether every weight came out bit for bit the same.
TRAIN_TWICE = """
import json, tempfile, torch
from slm_bench.lm.models import create_model, get_preset
from slm_bench.train.engine import CausalLM, PackedRows, TrainConfig, Trainer
spec = get_preset("llama-2m", max_position_embeddings=128)
ids = torch.randint(3, spec.vocab_size, (48, 128), generator=torch.Generator().manual_seed(0)).tolist()
rows = [{"input_ids": r, "labels": r, "position_ids": list(range(128))} for r in ids]

def weights_after(threads_at):
    config = TrainConfig(steps=10**9, micro_batch_size=8, lr=1e-3, progress=False, seed=0)
    trainer = Trainer(create_model(spec, seed=0), CausalLM(), PackedRows(rows, 8, 0), config, tempfile.mkdtemp())
    for step in range(6):
        torch.set_num_threads(threads_at(step))
        trainer.train_step()
    return trainer.model.state_dict()

one, switching = weights_after(lambda step: 1), weights_after(lambda step: 1 + step % 2)
print(json.dumps({"differing": sorted(k for k in one if not torch.equal(one[k], switching[k]))}))
"""


@pytest.mark.skipif(available_cores() < 2, reason="switching between one and two threads needs two cores")
def test_training_in_a_stage_environment_gives_the_same_weights_on_any_thread_count():
    """In the environment the runner gives a stage kernel (`engine_environment`; cpu.mkl_cbwr=AUTO,STRICT), weights
    trained on one thread and on a share that changes between one and two threads are identical. Without it
    (cpu.mkl_cbwr empty), on an AVX-512 Xeon, MKL sums the weight gradients' matmul differently on two threads and 71
    of the 75 tensors differ in their last bits (machine E)."""
    stage_env = engine_environment(engine_settings(PROFILES["tiny"]))
    assert stage_env["MKL_CBWR"] == "AUTO,STRICT"
    proc = subprocess.run([sys.executable, "-c", TRAIN_TWICE], env={**os.environ, **stage_env}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"differing": []}
