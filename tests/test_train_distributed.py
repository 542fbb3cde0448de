"""Data parallelism: 2 processes × 1 micro-batch equals 1 process × 2 accumulated micro-batches, bit for bit.

The engine runs under `accelerate launch --multi_gpu` unchanged: here on CPU (gloo), on a GPU node
with NCCL through the same accelerate code path; each process takes its share of every optimizer
step's micro-batches.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
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


def test_the_engine_launches_ddp_and_fsdp_itself_and_trains_what_one_process_trains(tmp_path):
    """`TrainConfig(strategy=..., processes=2)` from a single process (a stage's kernel): the engine hands the run to
    `accelerate launch` (train.launch) and loads the trained weights back into the same model object. With grad_accum 2
    split over 2 processes the global batch is unchanged, so DDP and FSDP (FSDP2, each decoder layer sharded) train the
    same weights as one process, bit for bit, and log the same losses."""
    import yaml

    from slm_bench.lm.models import create_model, get_preset
    from slm_bench.lm.packing import pack, text_example
    from slm_bench.lm.tokenizer import train_tokenizer
    from slm_bench.train.engine import CausalLM, PackedRows, TrainConfig, Trainer, read_metrics

    corpus = [f"Tom has {a} apples and buys {b} more, so he has {a + b} apples." for a in range(2, 30) for b in range(2, 12)]
    tokenizer = train_tokenizer(corpus, vocab_size=320)
    rows = pack([text_example(tokenizer, t) for t in corpus], seq_len=32, pad_id=tokenizer.pad_token_id)
    trained, last = {}, {}
    for strategy in ("single", "ddp", "fsdp"):
        model = create_model(get_preset("llama-0.5m", vocab_size=len(tokenizer), max_position_embeddings=64), seed=0)
        config = TrainConfig(steps=3, micro_batch_size=4, grad_accum=2, progress=False, strategy=strategy, processes=2,
                             launch_timeout_s=600)  # a stuck launch fails this test instead of holding the suite
        trainer = Trainer(model, CausalLM(), PackedRows(rows, 4, 0), config, tmp_path / strategy, tokenizer)
        last[strategy] = trainer.train(resume=False)
        assert trainer.trained_model() is model and trainer.step == 3  # the notebook's own model object holds the result
        trained[strategy] = {k: v.clone() for k, v in model.state_dict().items()}
    for strategy in ("ddp", "fsdp"):
        assert all(torch.equal(trained["single"][k], trained[strategy][k]) for k in trained["single"]), strategy
        assert [m["loss"] for m in read_metrics(tmp_path / strategy)] == [m["loss"] for m in read_metrics(tmp_path / "single")], strategy
        assert (last[strategy]["processes"], last[strategy]["global_batch_factor"]) == (2, 1)
        saved = load_file(tmp_path / strategy / "final" / "model.safetensors")
        assert all(torch.equal(saved[k], trained["single"][k]) for k in saved if k in trained["single"]), strategy
    launch = yaml.safe_load((tmp_path / "fsdp" / "launch" / "accelerate.yaml").read_text())
    assert (launch["distributed_type"], launch["num_processes"], launch["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"]) == \
        ("FSDP", 2, "LlamaDecoderLayer")
    assert yaml.safe_load((tmp_path / "ddp" / "launch" / "accelerate.yaml").read_text())["distributed_type"] == "MULTI_GPU"


def _running_with(text: str) -> list[int]:
    "The processes now running (zombies left out) whose command line contains `text`."
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # exited while we looked
            continue
        if text in command and state != "Z":
            found.append(int(proc.name))
    return found


def _wait_until(condition, within_s: float) -> bool:
    "Poll `condition()` every 0.1 s until it holds or `within_s` has passed; whether it held."
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def _train_failing_with(trainer, error: type, match: str, alongside) -> None:
    "`trainer.train()` raising `error` (message matching `match`) while `alongside(stop)` runs in a thread; `stop` is set and the thread joined either way."
    stop = threading.Event()
    side = threading.Thread(target=alongside, args=(stop,))
    side.start()
    try:
        with pytest.raises(error, match=match):
            trainer.train(resume=False)
    finally:
        stop.set()
        side.join()


def _endless_ddp_trainer(out: Path, launch_timeout_s: float):
    "A 2-process DDP trainer of a tiny model for 100,000 steps: far longer than any test waits."
    from slm_bench.lm.models import create_model, get_preset
    from slm_bench.lm.packing import pack, text_example
    from slm_bench.lm.tokenizer import train_tokenizer
    from slm_bench.train.engine import CausalLM, PackedRows, TrainConfig, Trainer

    corpus = [f"Tom has {a} apples." for a in range(2, 60)]
    tokenizer = train_tokenizer(corpus, vocab_size=300)
    rows = pack([text_example(tokenizer, t) for t in corpus], seq_len=16, pad_id=tokenizer.pad_token_id)
    model = create_model(get_preset("llama-0.5m", vocab_size=len(tokenizer), max_position_embeddings=32), seed=0)
    config = TrainConfig(steps=100_000, micro_batch_size=2, progress=False, strategy="ddp", processes=2,
                         launch_timeout_s=launch_timeout_s)
    return Trainer(model, CausalLM(), PackedRows(rows, 2, 0), config, out, tokenizer)


def test_a_launch_past_its_time_limit_is_stopped_with_every_process_it_started(tmp_path):
    """A launched run (100,000 steps: far longer than its limit) that outlives `launch_timeout_s` raises `TimeoutError`
    naming the limit, and leaves none of its processes running: the launcher and both trainers, all seen before the
    limit, are gone when `train()` returns."""
    trainer = _endless_ddp_trainer(tmp_path / "run", launch_timeout_s=30)
    folder = str(tmp_path / "run" / "launch")
    most = [0]

    def watch(stop: threading.Event):
        while not stop.is_set():
            most[0] = max(most[0], len(_running_with(folder)))
            time.sleep(0.1)

    _train_failing_with(trainer, TimeoutError, r"did not finish within launch_timeout_s=30 s, so its processes were stopped", watch)
    assert most[0] == 3  # accelerate's launcher and the two training processes ran before the limit
    assert _running_with(folder) == []
    assert not (tmp_path / "run" / "launch" / "result.json").exists() and trainer.step == 0


def test_training_processes_stop_when_their_launcher_is_killed(tmp_path):
    """SIGKILL gives accelerate's launcher no chance to stop its training processes (each in a session of its own):
    they stop themselves (`stop_with_parent`), so nothing trains on once `train()` has reported the dead launcher."""
    trainer = _endless_ddp_trainer(tmp_path / "run", launch_timeout_s=120)
    folder = str(tmp_path / "run" / "launch")
    killed = []

    def launchers_once_both_train() -> list[int]:
        trainers = _running_with(f"-m slm_bench.train.launch {folder}")  # the launcher has --module
        launchers = [pid for pid in _running_with(folder) if pid not in trainers]
        return launchers if len(trainers) == 2 and (tmp_path / "run" / "metrics.jsonl").exists() else []

    def kill_the_launcher_once_both_train(stop: threading.Event):
        if _wait_until(lambda: len(launchers_once_both_train()) == 1, within_s=100):
            launcher = launchers_once_both_train()[0]
            os.kill(launcher, signal.SIGKILL)
            killed.append(launcher)

    _train_failing_with(trainer, RuntimeError, r"failed with exit code -9", kill_the_launcher_once_both_train)
    assert len(killed) == 1
    _wait_until(lambda: not _running_with(folder), within_s=10)  # SIGTERM reaches them at once; exiting takes a moment
    assert _running_with(folder) == []


def test_a_killed_caller_takes_its_launched_run_along(tmp_path):
    """A stage kernel killed mid-training (SIGKILL, as the runner's stall watchdog and Ctrl-C do) leaves nothing
    training: its launcher stops with it (`stop_with_parent`), and stops the training processes."""
    out = tmp_path / "run"
    folder = str(out / "launch")
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from pathlib import Path; "
            f"from test_train_distributed import _endless_ddp_trainer; "
            f"_endless_ddp_trainer(Path({str(out)!r}), launch_timeout_s=120).train(resume=False)")
    caller = subprocess.Popen([sys.executable, "-c", code])
    training = lambda: _running_with(f"-m slm_bench.train.launch {folder}")
    _wait_until(lambda: len(training()) == 2 and (out / "metrics.jsonl").exists(), within_s=100)
    assert len(training()) == 2 and len(_running_with(folder)) == 3  # the launcher and both training processes
    caller.kill()
    caller.wait()
    _wait_until(lambda: not _running_with(folder), within_s=30)
    assert _running_with(folder) == []
