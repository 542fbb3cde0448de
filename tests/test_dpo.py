"""DPO: the loss and its gradient against the formula by hand, token and sequence pairs, and training a real tiny model."""
import math
from types import SimpleNamespace

import pytest
import torch

from slm_bench.core.errors import BadInput
from slm_bench.train.dpo import DPOObjective, dpo_loss, dpo_rows, policy_logps, reference_logps, sequence_pair_tensors, token_pair_tensors


class LogitTable(torch.nn.Module):
    "A 'language model' whose next-token logits are one learnable vector θ, whatever the context: log π(t) = θ_t − logsumexp(θ)."

    def __init__(self, theta):
        super().__init__()
        self.theta = torch.nn.Parameter(torch.tensor(theta))

    def forward(self, input_ids, logits_to_keep=0, **_):
        length = 1 if logits_to_keep == 1 else input_ids.shape[1]
        return SimpleNamespace(logits=self.theta.expand(input_ids.shape[0], length, -1))


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_token_pair_loss_and_gradient_by_hand():
    theta, beta, ref_c, ref_r = [0.3, -0.2, 0.5, 0.0], 0.5, -1.2, -0.7
    model = LogitTable(theta)
    tensors = token_pair_tensors([{"prompt_ids": [3, 1], "chosen_ids": [2], "rejected_ids": [1]}], pad_id=0)
    batch = {**tensors, "ref_chosen": torch.tensor([ref_c]), "ref_rejected": torch.tensor([ref_r])}
    loss, metrics = DPOObjective(beta).loss(model, batch)
    # log π(2) − log π(1) = θ2 − θ1 (the logsumexp cancels): margin = β(θ2 − θ1 − ref_c + ref_r) = 0.5 · 1.2
    margin = beta * (0.5 - (-0.2) - ref_c + ref_r)
    assert margin == pytest.approx(0.6)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-margin)), abs=1e-6)  # 0.43749
    assert metrics["reward_accuracy"] == 1.0 and metrics["margin"] == pytest.approx(0.6, abs=1e-6)
    loss.backward()
    g = beta * sigmoid(-margin)  # d(−log σ(m))/dm = −σ(−m)
    assert model.theta.grad.tolist() == pytest.approx([0.0, g, -g, 0.0], abs=1e-6)


def test_sequence_pair_loss_and_gradient_by_hand():
    theta, beta, ref_c, ref_r = [0.1, 0.4, -0.3, 0.2], 0.2, -3.0, -1.5
    model = LogitTable(theta)
    pair = {"prompt_ids": [3], "chosen_ids": [2, 2], "rejected_ids": [1]}
    tensors = sequence_pair_tensors([pair, pair], pad_id=0)
    batch = {**tensors, "ref_chosen": torch.tensor([ref_c] * 2), "ref_rejected": torch.tensor([ref_r] * 2)}
    loss, _ = DPOObjective(beta).loss(model, batch)
    t = torch.tensor(theta)
    lse = torch.logsumexp(t, 0).item()
    log_pi = [x - lse for x in theta]
    margin = beta * ((2 * log_pi[2] - ref_c) - (log_pi[1] - ref_r))
    assert loss.item() == pytest.approx(2 * math.log1p(math.exp(-margin)), abs=1e-5)  # summed over the two pairs
    loss.backward()
    softmax = torch.softmax(t, 0).tolist()
    d_margin = [beta * ((2 if k == 2 else 0) - (1 if k == 1 else 0) - softmax[k]) for k in range(4)]  # chosen has 2 tokens, rejected 1
    expected = [2 * -sigmoid(-margin) * d for d in d_margin]
    assert model.theta.grad.tolist() == pytest.approx(expected, abs=1e-5)


def test_dpo_loss_is_the_formula():
    losses, margins = dpo_loss(torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0]), torch.tensor([-1.0, -1.0]), torch.tensor([-1.0, -1.0]), 1.0)
    assert margins.tolist() == pytest.approx([1.0, -1.0])
    assert losses.tolist() == pytest.approx([math.log1p(math.exp(-1)), math.log1p(math.exp(1))])


def test_pair_tensors_reject_bad_pairs():
    with pytest.raises(BadInput, match="exactly one"):
        token_pair_tensors([{"prompt_ids": [1], "chosen_ids": [2, 3], "rejected_ids": [4]}], 0)
    with pytest.raises(BadInput, match="no DPO pairs"):
        sequence_pair_tensors([], 0)
    with pytest.raises(BadInput, match="longer|more than"):
        sequence_pair_tensors([{"prompt_ids": [1] * 10, "chosen_ids": [2], "rejected_ids": [3]}], 0, max_length=8)
    with pytest.raises(BadInput, match="beta"):
        DPOObjective(0)


def test_on_a_tiny_model_token_pairs_match_teacher_forcing_and_training_moves_the_pair(tiny_checkpoint, tmp_path):
    from slm_bench.lm.models import load_checkpoint
    from slm_bench.infer.sampling import HFSampler
    from slm_bench.train.engine import TrainConfig, Trainer

    model, tok = load_checkpoint(tiny_checkpoint)
    sampler = HFSampler(model, tok)
    prompts = [tok(f"Tom has {a} apples and buys")["input_ids"] for a in (5, 12, 23, 7)]
    seven, two = tok("7", add_special_tokens=False)["input_ids"][-1], tok("2", add_special_tokens=False)["input_ids"][-1]
    space = tok(" ", add_special_tokens=False)["input_ids"]
    pairs = [{"prompt_ids": p + space[-1:], "chosen_ids": [seven], "rejected_ids": [two]} for p in prompts]
    tensors = token_pair_tensors(pairs, tok.pad_token_id)  # prompts of different lengths: left padding
    chosen, rejected = reference_logps(model, tensors)
    teacher = sampler.score([p["prompt_ids"] for p in pairs], [[seven] for _ in pairs])
    assert chosen.tolist() == pytest.approx([t[0] for t in teacher], abs=1e-4)
    rows = dpo_rows(model, pairs, tok.pad_token_id, micro_batch_size=4)
    first = DPOObjective(0.5).loss(model, rows.micro_batch(0))
    assert first[0].item() / 4 == pytest.approx(math.log(2), abs=1e-5)  # policy = reference: every margin is 0
    before = reference_logps(model, tensors)
    Trainer(model, DPOObjective(0.5), rows, TrainConfig(steps=15, micro_batch_size=4, lr=3e-3, progress=False), tmp_path / "dpo", tok).train()
    after = reference_logps(model, tensors)
    assert ((after[0] - after[1]) - (before[0] - before[1]) > 0.5).all()  # chosen gained on rejected for every pair


def test_sequence_pairs_on_a_tiny_model(tiny_checkpoint):
    from slm_bench.lm.models import load_checkpoint
    from slm_bench.infer.sampling import HFSampler

    model, tok = load_checkpoint(tiny_checkpoint)
    prompt = tok("Tom has 5 apples and buys")["input_ids"]
    good = tok(" 3 more, so he has 8 apples.", add_special_tokens=False)["input_ids"]
    bad = tok(" 3 more, so he has 9 apples.", add_special_tokens=False)["input_ids"]
    tensors = sequence_pair_tensors([{"prompt_ids": prompt, "chosen_ids": good, "rejected_ids": bad}], tok.pad_token_id)
    chosen, rejected = policy_logps(model, tensors)
    teacher = HFSampler(model, tok).score([prompt, prompt], [good, bad])
    assert chosen.item() == pytest.approx(sum(teacher[0]), abs=1e-3) and rejected.item() == pytest.approx(sum(teacher[1]), abs=1e-3)
