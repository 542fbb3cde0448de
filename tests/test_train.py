"""The training engine: schedules, exact accumulation, determinism, exact resume, checkpoints, packing masks, learning."""
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from slm_bench.lm.models import create_model, get_preset
from slm_bench.lm.packing import IGNORE, chat_example, pack, prompt_completion_example, text_example
from slm_bench.lm.tokenizer import train_tokenizer
from slm_bench.train.engine import CausalLM, PackedRows, TrainConfig, Trainer, latest_checkpoint, make_optimizer, make_schedule, read_metrics

CORPUS = [f"Tom has {a} apples and buys {b} more, so he has {a + b} apples." for a in range(2, 30) for b in range(2, 12)]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CORPUS, vocab_size=320)


def tiny_model(tokenizer, seed=0, name="llama-0.5m", positions=64):
    return create_model(get_preset(name, vocab_size=len(tokenizer), max_position_embeddings=positions), seed=seed,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def rows_for(tokenizer, seq_len=32, n=None):
    examples = [text_example(tokenizer, t) for t in CORPUS[:n]]
    return pack(examples, seq_len=seq_len, pad_id=tokenizer.pad_token_id, mode="concat")


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run(tokenizer, out, steps, seed=0, resume=True, **cfg):
    config = TrainConfig(steps=steps, micro_batch_size=cfg.pop("micro_batch_size", 4), seed=seed, progress=False, **cfg)
    trainer = Trainer(tiny_model(tokenizer, seed=seed), CausalLM(), PackedRows(rows_for(tokenizer), config.micro_batch_size, seed), config, out, tokenizer)
    trainer.train(resume=resume)
    return trainer


def assert_trains_alike(train, tmp_path, rel=1e-5, atol=1e-5):
    "`train(flag, out)` → a trained Trainer; the runs with flag True and False log the same losses and end with the same weights (fp32, to `rel` and `atol`)."
    results = {}
    for flag in (True, False):
        trainer = train(flag, tmp_path / str(flag))
        results[flag] = ([m["loss"] for m in read_metrics(tmp_path / str(flag))], weights(trainer.model))
    assert results[True][0] == pytest.approx(results[False][0], rel=rel)
    for k, w in results[True][1].items():
        assert torch.allclose(w, results[False][1][k], atol=atol), k


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_schedules_follow_their_formulas(schedule):
    config = TrainConfig(steps=20, warmup_steps=4, lr=2.0, schedule=schedule, min_lr_ratio=0.1)
    model = torch.nn.Linear(3, 3)
    optimizer = make_optimizer(model, config)
    sched = make_schedule(optimizer, config)
    for s in range(20):
        lr = sched.get_last_lr()[0]
        if s < 4:
            expected = 2.0 * s / 4
        elif schedule == "cosine":
            expected = 2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 4) / 16)))
        elif schedule == "linear":
            expected = 2.0 * (20 - s) / 16
        else:
            expected = 2.0
        assert lr == pytest.approx(expected, abs=1e-12), (schedule, s)
        optimizer.step()
        sched.step()


def test_adamw_groups():
    model = create_model("llama-0.5m")
    optimizer = make_optimizer(model, TrainConfig(weight_decay=0.1, betas=(0.9, 0.95), eps=1e-5))
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() == 1 for p in plain["params"])  # norms not decayed
    assert decayed["betas"] == (0.9, 0.95) and decayed["eps"] == 1e-5


def test_accumulation_equals_one_big_batch(tokenizer, tmp_path):
    # SFT-like rows with different numbers of labelled tokens per micro-batch: exact normalisation matters
    examples = [prompt_completion_example(tokenizer, f"Tom has {a} apples.", f" He has {a + 3} now." * (1 + a % 3)) for a in range(2, 40)]
    rows = pack(examples, seq_len=32, pad_id=tokenizer.pad_token_id, mode="greedy")
    results = []
    for micro, accum in ((8, 1), (2, 4), (1, 8)):
        config = TrainConfig(steps=1, micro_batch_size=micro, grad_accum=accum, lr=1e-2, grad_clip=None, progress=False,
                             mixed_precision="no")  # exact in fp32; under bf16 autocast the two differ by rounding
        data = PackedRows(rows, micro, seed=0)
        data.micro_batch = (lambda full: (lambda i: {k: v[i * micro:(i + 1) * micro] for k, v in full.items()}))(PackedRows(rows, 8, seed=0).micro_batch(0))
        trainer = Trainer(tiny_model(tokenizer), CausalLM(), data, config, tmp_path / f"{micro}x{accum}", tokenizer)
        metrics = trainer.train_step()
        results.append((metrics["loss"], weights(trainer.model)))
    for loss, w in results[1:]:
        assert loss == pytest.approx(results[0][0], rel=1e-5)
        for k in w:
            assert torch.allclose(w[k], results[0][1][k], atol=1e-6), k


def test_deterministic_and_logs_metrics(tokenizer, tmp_path):
    a = run(tokenizer, tmp_path / "a", steps=5)
    b = run(tokenizer, tmp_path / "b", steps=5)
    ma, mb = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [m["loss"] for m in ma] == [m["loss"] for m in mb]
    assert all(torch.equal(x, y) for x, y in zip(weights(a.model).values(), weights(b.model).values()))
    assert [m["step"] for m in ma] == [1, 2, 3, 4, 5]
    assert {"loss", "lr", "grad_norm", "tokens", "tokens_seen", "tokens_per_s"} <= set(ma[0])
    assert ma[-1]["tokens_seen"] == 5 * 4 * 32
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "final")
    assert all(torch.equal(final.state_dict()[k], v) for k, v in weights(a.model).items())


def test_exact_resume(tokenizer, tmp_path):
    straight = run(tokenizer, tmp_path / "straight", steps=6, grad_accum=2, warmup_steps=2)
    cfg = dict(grad_accum=2, warmup_steps=2, checkpoint_every=3)
    first = Trainer(tiny_model(tokenizer), CausalLM(), PackedRows(rows_for(tokenizer), 4, 0),
                    TrainConfig(steps=6, micro_batch_size=4, progress=False, **cfg), tmp_path / "resumed", tokenizer)
    for _ in range(4):  # step 4 runs after the step-3 checkpoint, then the process "dies"
        first.train_step()
        if first.step == 3:
            first.save()
    assert latest_checkpoint(tmp_path / "resumed").name == "step-000003"
    second = Trainer(tiny_model(tokenizer, seed=123), CausalLM(), PackedRows(rows_for(tokenizer), 4, 0),
                     TrainConfig(steps=6, micro_batch_size=4, progress=False, **cfg), tmp_path / "resumed", tokenizer)
    second.train(resume=True)
    assert second.step == 6
    for k, v in weights(straight.model).items():
        assert torch.equal(v, weights(second.model)[k]), k
    assert [m["loss"] for m in read_metrics(tmp_path / "straight")][3:] == [m["loss"] for m in read_metrics(tmp_path / "resumed")][-3:]


def test_named_and_periodic_checkpoints(tokenizer, tmp_path):
    run(tokenizer, tmp_path / "out", steps=7, checkpoint_every=2, checkpoint_at=(3, 5))
    kept = sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir())
    assert kept == ["step-000003", "step-000005", "step-000006"]  # named ones kept, only the latest periodic one
    named = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "checkpoints" / "step-000003" / "model")
    assert named.config.vocab_size == len(tokenizer)
    assert not (tmp_path / "out" / "checkpoints" / "step-000006" / "model").exists()
    assert json.loads((tmp_path / "out" / "checkpoints" / "step-000005" / "state.json").read_text())["step"] == 5


def test_sft_loss_counts_only_answer_tokens(tokenizer):
    example = chat_example(tokenizer, [{"role": "user", "content": "Tom has 3 apples."}, {"role": "assistant", "content": "He has 3 apples."}])
    rows = pack([example], seq_len=48, pad_id=tokenizer.pad_token_id, mode="greedy")
    batch = {k: torch.tensor([rows[0][k]]) for k in rows[0]}
    model = tiny_model(tokenizer)
    objective = CausalLM()
    total, _ = objective.loss(model, batch)
    logits = model(torch.tensor([example["input_ids"]])).logits[0, :-1]
    answer = [t for t, l in enumerate(example["labels"]) if l != IGNORE and t > 0]
    manual = sum(-torch.log_softmax(logits[t - 1], -1)[example["input_ids"][t]] for t in answer)
    assert objective.units(batch) == len(answer) and total.item() == pytest.approx(manual.item(), rel=1e-5)


@pytest.mark.parametrize("name", ["llama-0.5m", "phi-0.5m"])
def test_packed_examples_do_not_attend_to_each_other(tokenizer, name):
    model = tiny_model(tokenizer, name=name).eval()
    first, second = text_example(tokenizer, CORPUS[0]), text_example(tokenizer, CORPUS[57])
    alone = model(torch.tensor([second["input_ids"]])).logits[0]
    n = len(first["input_ids"])
    for cross, same in ((False, True), (True, False)):
        row = pack([first, second], seq_len=64, pad_id=tokenizer.pad_token_id, mode="greedy", cross_attention=cross, seed=0)[0]
        if row["input_ids"][:n] != first["input_ids"]:  # greedy shuffles: find where `second` sits
            start = 0
        else:
            start = n
        packed = model(input_ids=torch.tensor([row["input_ids"]]), position_ids=torch.tensor([row["position_ids"]]), use_cache=False).logits[0]
        segment = packed[start:start + len(second["input_ids"])]
        assert torch.allclose(segment, alone, atol=1e-5) == same, f"cross_attention={cross}"


def test_the_model_learns(tokenizer, tmp_path):
    trainer = run(tokenizer, tmp_path / "learn", steps=40, lr=3e-3, warmup_steps=4)
    losses = [m["loss"] for m in read_metrics(tmp_path / "learn")]
    assert losses[-1] < 0.5 * losses[0], losses[::8]
    assert math.log(len(tokenizer)) == pytest.approx(losses[0], rel=0.1)  # starts near uniform


@pytest.mark.parametrize("name", ["llama-0.5m", "phi-0.5m"])
def test_packed_loss_is_the_sum_of_separate_losses(tokenizer, name):
    "The objective's own forward pass keeps packed examples apart: packed loss = sum of the examples' losses alone."
    model, objective = tiny_model(tokenizer, name=name).eval(), CausalLM()
    examples = [text_example(tokenizer, CORPUS[i]) for i in (0, 57, 133)]
    packed = pack(examples, seq_len=64, pad_id=tokenizer.pad_token_id, mode="greedy")
    assert len(packed) == 1
    as_batch = lambda row: {k: torch.tensor([row[k]]) for k in row}
    alone = [pack([ex], seq_len=64, pad_id=tokenizer.pad_token_id, mode="greedy")[0] for ex in examples]
    separate = sum(objective.loss(model, as_batch(r))[0].item() for r in alone)
    assert objective.loss(model, as_batch(packed[0]))[0].item() == pytest.approx(separate, rel=1e-5)
    assert objective.units(as_batch(packed[0])) == sum(objective.units(as_batch(r)) for r in alone)


@pytest.mark.parametrize("name", ["llama-0.5m", "phi-0.5m"])
def test_attention_within_segments_trains_exactly_as_the_mask_path(tokenizer, tmp_path, name):
    "lm.attention's per-example attention gives the same losses and weights as transformers' block mask (fp32)."
    from slm_bench.lm.attention import MIN_WIDTH, packed_segments

    examples = [prompt_completion_example(tokenizer, f"Tom has {a} apples.", f" He has {a + 3} now." * (1 + a % 9)) for a in range(2, 80)]
    rows = pack(examples, seq_len=MIN_WIDTH, pad_id=tokenizer.pad_token_id, mode="greedy")
    first = PackedRows(rows, 2, seed=0).micro_batch(0)
    scored = torch.nn.functional.pad(first["labels"][:, 1:] != IGNORE, (0, 1))  # what CausalLM passes
    assert packed_segments(first["position_ids"], scored) is not None  # many examples to a row: the segment path runs
    def train(within, out):
        config = TrainConfig(steps=3, micro_batch_size=2, lr=1e-2, progress=False, mixed_precision="no")
        trainer = Trainer(tiny_model(tokenizer, name=name, positions=MIN_WIDTH), CausalLM(within_segments=within), PackedRows(rows, 2, seed=0), config, out, tokenizer)
        trainer.train()
        assert trainer.model.config._attn_implementation == "sdpa"  # switched back after every step
        return trainer

    assert_trains_alike(train, tmp_path)


@pytest.mark.parametrize("name", ["llama-0.5m", "phi-0.5m"])
def test_output_head_on_labelled_positions_trains_exactly_as_the_whole_forward(tokenizer, tmp_path, name):
    "scored_logits (the head at labelled positions only) gives the same losses and weights as every position's logits (fp32)."
    examples = [prompt_completion_example(tokenizer, f"Tom has {a} apples.", f" He has {a + 3} now.") for a in range(2, 60)]
    rows = pack(examples, seq_len=48, pad_id=tokenizer.pad_token_id, mode="greedy")
    labelled = sum(l != IGNORE for r in rows for l in r["labels"][1:])
    assert 0 < labelled < 0.6 * len(rows) * 47  # prompts and padding unlabelled: the head skips a real share
    def train(scored_only, out):
        config = TrainConfig(steps=3, micro_batch_size=4, lr=1e-2, progress=False, mixed_precision="no")
        trainer = Trainer(tiny_model(tokenizer, name=name), CausalLM(scored_only=scored_only), PackedRows(rows, 4, seed=0), config, out, tokenizer)
        trainer.train()
        return trainer

    assert_trains_alike(train, tmp_path)


def test_dpo_sequence_logps_sum_the_response_tokens(tokenizer):
    "policy_logps on sequence pairs: per row, the sum of log p(token) over the response tokens, from the whole forward by hand."
    from slm_bench.train.dpo import policy_logps

    model = tiny_model(tokenizer).eval()
    pairs, width = 3, 20
    ids = torch.randint(3, len(tokenizer), (pairs, 2, width), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[..., :7] = IGNORE  # the prompt
    labels[0, 1, 15:] = IGNORE  # a shorter rejected response (right padding)
    chosen, rejected = policy_logps(model, {"input_ids": ids, "labels": labels})
    head_only = policy_logps(model, {"input_ids": ids, "labels": labels}, scored_only=True)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids.view(2 * pairs, width)).logits.float(), -1)
    expected = torch.zeros(2 * pairs)
    for row in range(2 * pairs):
        for t in range(1, width):
            if labels.view(2 * pairs, width)[row, t] != IGNORE:
                expected[row] += logprobs[row, t - 1, ids.view(2 * pairs, width)[row, t]]
    assert torch.allclose(chosen.detach(), expected.view(pairs, 2)[:, 0], atol=1e-4)
    assert torch.allclose(rejected.detach(), expected.view(pairs, 2)[:, 1], atol=1e-4)
    assert torch.allclose(head_only[0].detach(), expected.view(pairs, 2)[:, 0], atol=1e-4)
    assert torch.allclose(head_only[1].detach(), expected.view(pairs, 2)[:, 1], atol=1e-4)


def test_verifier_attention_within_segments_trains_exactly_as_the_mask_path(tokenizer, tmp_path):
    "The token verifier on packed rows: attending example by example gives the mask path's losses and weights (fp32)."
    from slm_bench.lm.attention import packed_segments
    from slm_bench.train.verifier import TokenVerifierObjective, VerifierModel, verifier_example

    examples = []
    for a in range(2, 80):
        prompt = tokenizer(f"Tom has {a} apples.")["input_ids"]
        solution = tokenizer(f" He has {a + 3} now." * (1 + a % 5), add_special_tokens=False)["input_ids"]
        examples.append(verifier_example(prompt, solution, label=a % 3 != 0))
    rows = pack(examples, seq_len=256, pad_id=tokenizer.pad_token_id, mode="greedy")
    first = PackedRows(rows, 2, seed=0).micro_batch(0)
    assert packed_segments(first["position_ids"], first["labels"] != IGNORE, min_width=TokenVerifierObjective.MIN_WIDTH) is not None
    def train(within, out):
        config = TrainConfig(steps=3, micro_batch_size=2, lr=1e-2, progress=False, mixed_precision="no")
        verifier = VerifierModel.from_generator(tiny_model(tokenizer, positions=256))
        trainer = Trainer(verifier, TokenVerifierObjective(within_segments=within), PackedRows(rows, 2, seed=0), config, out, tokenizer)
        trainer.train()
        assert verifier.backbone.config._attn_implementation == "sdpa"  # switched back after every step
        return trainer

    assert_trains_alike(train, tmp_path)


def test_compiled_model_trains_as_the_eager_one_and_saves_a_plain_checkpoint(tokenizer, tmp_path):
    "TrainConfig(compile=True): inductor's fused kernels give the eager run's losses and weights (fp32, to rounding), the compiled graph really ran, and final/ is a plain HF checkpoint."
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    def train(compiled, out):
        config = TrainConfig(steps=3, micro_batch_size=4, lr=1e-2, progress=False, mixed_precision="no", compile=compiled)
        trainer = Trainer(tiny_model(tokenizer), CausalLM(), PackedRows(rows_for(tokenizer), 4, seed=0), config, out, tokenizer)
        trainer.train()
        if compiled:
            assert counters["stats"]["unique_graphs"] >= 1  # dynamo captured the forward: the steps ran compiled
            trained, final = weights(trainer.model), AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
            assert set(final) == set(trained)  # no compile wrapper in the saved names
            assert all(torch.equal(final[k], v) for k, v in trained.items())
        return trainer

    assert_trains_alike(train, tmp_path, rel=1e-4, atol=1e-4)
