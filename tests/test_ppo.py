"""Llama 2's PPO: the reward shaping, GAE, the clipped loss by hand, and the loop on a toy reward (KL starts at zero, β holds the policy back)."""
import copy
import json
import math

import pytest
import torch

from slm_bench.core.errors import BadInput
from slm_bench.lm.models import create_model, get_preset
from slm_bench.lm.tokenizer import train_tokenizer
from slm_bench.methods.llama2_ppo import TinyWorldReward, oracle_verdicts
from slm_bench.methods.preferences import Facts, PreferencePrompt
from slm_bench.methods.rejection_sampling import combined_reward, whitened_logits
from slm_bench.train.ppo import (PPOConfig, PPOTrainer, clipped_policy_loss, clipped_value_loss, gae_advantages, gae_reference, masked_whiten,
                                 rollout_tensors, token_logps, token_rewards, whiten)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([f"x = {i} + {i * 7}" for i in range(200)], vocab_size=300)


@pytest.fixture(scope="module")
def model(tokenizer):
    return create_model(get_preset("llama-0.5m", vocab_size=len(tokenizer), max_position_embeddings=64), seed=0)


def test_the_combined_reward_rule_then_logit_and_whitening_by_hand():
    # helpfulness prompt with a safe response: R_h; safety score under 0.15: R_s; safety prompt: R_s
    rc = combined_reward([0.9, 0.7, 0.2], [0.5, 0.1, 0.5], [False, False, True])
    assert rc == [0.9, 0.1, 0.5]
    # logits log 9, −log 9, 0: mean 0, population std log 9 · sqrt(2/3)
    assert whitened_logits(rc) == pytest.approx([1 / math.sqrt(2 / 3), -1 / math.sqrt(2 / 3), 0.0], abs=1e-9)


def test_token_rewards_charge_the_kl_per_token_or_once():
    mask = torch.tensor([[0, 1, 1, 1, 0]])
    log_ratio = torch.tensor([[5.0, 0.2, -0.1, 0.4, 5.0]])
    per_token = token_rewards(torch.tensor([2.0]), log_ratio, mask, beta=0.5, kl_mode="token")
    assert per_token[0].tolist() == pytest.approx([0.0, -0.1, 0.05, 2.0 - 0.2, 0.0])
    once = token_rewards(torch.tensor([2.0]), log_ratio, mask, beta=0.5, kl_mode="sequence")
    assert once[0].tolist() == pytest.approx([0.0, 0.0, 0.0, 2.0 - 0.5 * 0.5, 0.0])
    assert per_token.sum().item() == pytest.approx(once.sum().item())  # the same total, placed differently


def test_batched_gae_equals_the_textbook_loop():
    generator = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(4, 9, generator=generator), torch.randn(4, 9, generator=generator)
    mask = torch.zeros(4, 9, dtype=torch.bool)
    for row, (start, end) in enumerate([(0, 9), (3, 5), (8, 9), (2, 8)]):
        mask[row, start:end] = True
    advantages, returns = gae_advantages(rewards, values, mask, gamma=0.95, lam=0.9)
    for row in range(4):
        on = mask[row]
        assert advantages[row][on].tolist() == pytest.approx(gae_reference(rewards[row][on].tolist(), values[row][on].tolist(), 0.95, 0.9), abs=1e-5)
        assert advantages[row][~on].abs().sum().item() == 0.0
    assert returns[mask].tolist() == pytest.approx((advantages + values)[mask].tolist(), abs=1e-6)


def test_the_clipped_loss_on_a_two_token_toy_by_hand():
    new, old = torch.tensor([[0.6, 0.3]]).log(), torch.tensor([[0.4, 0.5]]).log()
    loss, info = clipped_policy_loss(new, old, torch.tensor([[1.0, -1.0]]), torch.tensor([[1, 1]]), clip=0.2)
    # ratio 1.5 with A = +1: clipped to 1.2, loss −1.2; ratio 0.6 with A = −1: max(0.6, 0.8) = 0.8
    assert loss.item() == pytest.approx(-0.2)
    assert info["clip_fraction"] == 1.0
    # with a wide clip the plain surrogate −A·ratio is back: (−1.5 + 0.6) / 2
    loss, info = clipped_policy_loss(new, old, torch.tensor([[1.0, -1.0]]), torch.tensor([[1, 1]]), clip=0.9)
    assert loss.item() == pytest.approx(-0.45)
    assert info["clip_fraction"] == 0.0
    # the gradient of a clipped token is zero: only the unclipped one moves
    new = torch.tensor([[0.6, 0.45]]).log().requires_grad_()
    clipped_policy_loss(new, old, torch.tensor([[1.0, -1.0]]), torch.tensor([[1, 1]]), clip=0.2)[0].backward()
    assert new.grad[0, 0].item() == 0.0 and new.grad[0, 1].item() == pytest.approx(0.5 * 0.45 / 0.5)
    assert clipped_value_loss(torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[2.0]]), torch.tensor([[1]]), 0.2).item() == pytest.approx(1.62)


def test_whitening():
    assert whiten([1.0, 2.0, 3.0]) == pytest.approx([-math.sqrt(1.5), 0.0, math.sqrt(1.5)])
    x = masked_whiten(torch.tensor([[1.0, 3.0, 50.0]]), torch.tensor([[1, 1, 0]]))
    assert x.tolist() == [[-1.0, 1.0, 0.0]]


def test_rollout_mask_marks_exactly_the_response_positions(model):
    batch = rollout_tensors([[1, 4, 5], [1, 6]], [[7, 8, 2], [2]], pad_id=0)
    assert batch["mask"].int().tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]
    assert token_logps(model, batch["input_ids"]).shape == (2, 5)
    with pytest.raises(BadInput, match="one response per prompt"):
        rollout_tensors([[1]], [[2], [3]], 0)


def _share_of(token):
    def reward(items, completions):
        shares = [sum(t == token for t in c.token_ids) / max(len(c.token_ids), 1) for c in completions]
        return whiten(shares), {"share": shares}
    return reward


def _toy_run(model, tokenizer, tmp_path, **overrides):
    settings = dict(iterations=25, batch_size=32, mini_batch_size=8, lr=3e-3, max_new_tokens=4, eval_every=0, progress=False)
    trainer = PPOTrainer(copy.deepcopy(model), tokenizer, _share_of(40), PPOConfig(**{**settings, **overrides}), tmp_path)
    prompts = [[tokenizer.bos_token_id, 10 + i] for i in range(32)]
    return trainer, trainer.train(list(range(32)), prompts)


def test_ppo_raises_the_reward_it_is_given_and_the_kl_starts_at_zero(model, tokenizer, tmp_path):
    trainer, history = _toy_run(model, tokenizer, tmp_path / "ppo")
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-4)  # the first batch is sampled from π0 itself
    assert history[-1]["share"] > history[0]["share"] + 0.3
    assert (tmp_path / "ppo" / "final" / "config.json").is_file()
    _toy_run(model, tokenizer, tmp_path / "ppo", iterations=2)  # a restart in the same folder starts the log afresh
    assert [json.loads(line)["iteration"] for line in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_the_kl_penalty_holds_the_policy_near_its_start(model, tokenizer, tmp_path):
    _, free = _toy_run(model, tokenizer, tmp_path / "free", kl_beta=0.0)
    _, held = _toy_run(model, tokenizer, tmp_path / "held", kl_beta=2.0)
    assert held[-1]["kl"] < free[-1]["kl"] / 2


def test_the_critic_learns_the_returns(model, tokenizer, tmp_path):
    from slm_bench.train.verifier import VerifierModel

    critic = VerifierModel.from_generator(model)
    # the policy held still (lr 0) and a return the prompt decides (even prompts +1, odd −1): the critic can learn it exactly
    config = PPOConfig(iterations=15, batch_size=32, mini_batch_size=8, lr=0.0, max_new_tokens=4, eval_every=0, progress=False,
                       value_model="critic", value_lr=3e-3)
    parity = lambda items, completions: (whiten([float(i % 2 == 0) for i in items]), {})
    trainer = PPOTrainer(copy.deepcopy(model), tokenizer, parity, config, tmp_path, critic=critic)
    history = trainer.train(list(range(32)), [[tokenizer.bos_token_id, 10 + i] for i in range(32)])
    assert history[-1]["value_loss"] < history[0]["value_loss"] / 4
    with pytest.raises(BadInput, match="takes no critic"):
        PPOTrainer(model, tokenizer, parity, PPOConfig(), tmp_path, critic=critic)


def test_early_stopping_keeps_the_best_held_out_weights(model, tokenizer, tmp_path):
    scores = iter([0.5, 0.9, 0.1, 0.2])  # at iterations 0, 2, 4, 6: the best is iteration 2
    config = PPOConfig(iterations=8, batch_size=32, mini_batch_size=8, lr=3e-3, max_new_tokens=4, eval_every=2, patience=2, progress=False)
    trainer = PPOTrainer(copy.deepcopy(model), tokenizer, _share_of(40), config, tmp_path)
    history = trainer.train(list(range(32)), [[tokenizer.bos_token_id, 10 + i] for i in range(32)], eval_fn=lambda policy: next(scores))
    assert trainer.best["iteration"] == 2
    assert history[-1]["iteration"] == 6  # two evaluations without a gain: stopped
    kept = trainer.best["state"]
    assert all(torch.equal(kept[k], v) for k, v in trainer.policy.state_dict().items())


def test_the_oracle_verdict_per_prompt_kind():
    items = [PreferencePrompt("h", "helpfulness", "q", 4), PreferencePrompt("u", "safety", "q", None, unsafe_request=True),
             PreferencePrompt("b", "safety", "q", 6)]
    assert oracle_verdicts(items, [Facts(True, False, False), Facts(True, False, True, ("network",)), Facts(True, True, False)]) == [False, False, True]


def test_the_reward_sources_score_the_same_responses_differently(tokenizer):
    from slm_bench.evals.sandbox import Sandbox
    from slm_bench.infer.sampling import Completion
    from slm_bench.train.reward import RewardModel

    lm = create_model(get_preset("llama-0.5m", vocab_size=len(tokenizer), max_position_embeddings=256), seed=2)
    rm = RewardModel.from_generator(lm)
    torch.nn.init.normal_(rm.head.weight, std=0.5)
    items = [PreferencePrompt(str(i), "helpfulness", f"What is {i} plus 2?", i + 2) for i in range(4)]
    bodies = [f"    result = {i} + 2\n    return result\n" if i % 2 == 0 else "    return 0\n" for i in range(4)]
    completions = [Completion(tokenizer(b, add_special_tokens=False)["input_ids"], b, [], "stop") for b in bodies]
    with Sandbox() as box:
        rm_scores, facts = TinyWorldReward(rm, rm, tokenizer, box, "rm")(items, completions)
        exec_scores, _ = TinyWorldReward(rm, rm, tokenizer, box, "execution")(items, completions)
    assert facts["oracle"] == [1.0, 0.0, 1.0, 0.0]
    assert exec_scores == [1.0, -1.0, 1.0, -1.0]
    assert rm_scores == pytest.approx(whitened_logits(facts["rc"]))
    with pytest.raises(BadInput, match="'rm' or 'execution'"):
        TinyWorldReward(rm, rm, tokenizer, None, "judge")
