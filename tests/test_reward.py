"""Llama 2's reward model: the ranking loss against TRL's RewardTrainer on the same batch, and training that learns a constructed preference."""
import math

import pytest
import torch

from slm_bench.lm.models import create_model, get_preset
from slm_bench.lm.tokenizer import train_tokenizer
from slm_bench.methods.preferences import MARGINS, RATINGS
from slm_bench.train.reward import RankingObjective, RewardModel, accuracy_by_rating, ranking_loss, reward_pair_tensors


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([f"def f():\n    return {i} + {i * 3}\n" for i in range(80)], vocab_size=300)


def _pairs(tokenizer, count=6):
    prompt = tokenizer("def f():\n")["input_ids"]
    pairs = []
    for i in range(count):
        pairs.append({"prompt_ids": prompt, "chosen_ids": tokenizer(f"    return {i} + {i * 3}\n")["input_ids"],
                      "rejected_ids": tokenizer(f"    return {i}\n")["input_ids"], "rating": RATINGS[i % 4]})
    return pairs


def test_our_ranking_loss_equals_trl_reward_trainer_loss_with_a_margin_column(tokenizer, tmp_path):
    from datasets import Dataset
    from transformers import LlamaForSequenceClassification
    from trl import RewardConfig, RewardTrainer
    from trl.trainer.reward_trainer import DataCollatorForPreference

    pad = tokenizer.pad_token_id
    lm = create_model(get_preset("llama-0.5m", vocab_size=len(tokenizer)), seed=3, pad_token_id=pad)
    ours = RewardModel.from_generator(lm)
    torch.nn.init.normal_(ours.head.weight, std=0.5)  # a head that separates the responses, so the margins matter
    config = lm.config.__class__.from_dict({**lm.config.to_dict(), "num_labels": 1, "pad_token_id": pad})
    theirs = LlamaForSequenceClassification(config)
    theirs.model.load_state_dict(ours.backbone.state_dict())
    theirs.score.weight.data.copy_(ours.head.weight.data)  # TRL's score layer has no bias; ours starts at zero
    assert ours.head.bias.item() == 0.0

    pairs = _pairs(tokenizer)
    margins = [MARGINS["large"][p["rating"]] for p in pairs]
    loss_sum, _ = RankingObjective().loss(ours, reward_pair_tensors(pairs, pad, margins))
    examples = [{"chosen_ids": p["prompt_ids"] + p["chosen_ids"], "rejected_ids": p["prompt_ids"] + p["rejected_ids"], "margin": m}
                for p, m in zip(pairs, margins)]
    try:
        trainer = RewardTrainer(model=theirs, args=RewardConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True),
                                train_dataset=Dataset.from_list(examples), processing_class=tokenizer)
        trl_loss = trainer.compute_loss(theirs, DataCollatorForPreference(pad_token_id=pad)(examples))
    finally:  # the HF Trainer fixes accelerate's process-wide state; our engine sets its own
        from accelerate.state import AcceleratorState
        AcceleratorState._reset_state(reset_partial_state=True)
    assert trl_loss.item() == pytest.approx(loss_sum.item() / len(pairs), abs=1e-5)  # TRL averages, the engine sums
    assert trl_loss.item() != pytest.approx(RankingObjective().loss(ours, reward_pair_tensors(pairs, pad))[0].item() / len(pairs), abs=1e-3)


def test_the_ranking_loss_by_hand_for_each_margin_table():
    chosen, rejected = torch.tensor([1.5] * 4), torch.tensor([0.5] * 4)  # r_c - r_r = 1 for every rating
    by_hand = {"none": [0.313262] * 4,  # log(1 + e^-1)
               "small": [0.693147, 0.540306, 0.414370, 0.313262],  # log(1 + e^-(1 - m)) for m = 1, 2/3, 1/3, 0
               "large": [2.126928, 1.313262, 0.693147, 0.313262]}  # m = 3, 2, 1, 0
    for table, expected in by_hand.items():
        margin = torch.tensor([MARGINS[table][r] for r in RATINGS])
        assert ranking_loss(chosen, rejected, margin).tolist() == pytest.approx(expected, abs=1e-6), table


def test_one_epoch_learns_a_constructed_preference_and_accuracy_is_per_rating(tokenizer, tmp_path):
    from slm_bench.train.engine import PackedRows, Trainer
    from slm_bench.train.reward import reward_config, reward_scores

    pad = tokenizer.pad_token_id
    model = RewardModel.from_generator(create_model(get_preset("llama-0.5m", vocab_size=len(tokenizer)), seed=0, pad_token_id=pad))
    train, held_out = _pairs(tokenizer, 40)[:32], _pairs(tokenizer, 40)[32:]
    config = reward_config(len(train) * 8, micro_batch_size=8, lr=3e-3, seed=0, progress=False)  # 8 passes over 32 pairs
    rows = PackedRows.from_tensors(reward_pair_tensors(train * 8, pad, [MARGINS["small"][p["rating"]] for p in train * 8]), 8, seed=0)
    Trainer(model, RankingObjective(), rows, config, tmp_path, tokenizer).train()
    prompts = [p["prompt_ids"] for p in held_out]
    chosen = reward_scores(model, prompts, [p["chosen_ids"] for p in held_out])
    rejected = reward_scores(model, prompts, [p["rejected_ids"] for p in held_out])
    accuracy = accuracy_by_rating(chosen, rejected, [p["rating"] for p in held_out], RATINGS)
    assert [accuracy[r]["n"] for r in RATINGS] == [2, 2, 2, 2]
    assert accuracy["all"]["accuracy"] == 1.0  # "a + b" is preferred to "a" on pairs it never saw


def test_pair_rewards_ignore_right_padding_past_the_batch_longest_row(tokenizer):
    "The batch is cut to its longest row: the same pairs padded 40 tokens wider give the same rewards."
    from slm_bench.train.reward import pair_rewards

    pad = tokenizer.pad_token_id
    model = RewardModel.from_generator(create_model(get_preset("llama-0.5m", vocab_size=len(tokenizer)), seed=1, pad_token_id=pad))
    torch.nn.init.normal_(model.head.weight, std=0.5)
    batch = reward_pair_tensors(_pairs(tokenizer), pad)
    wide = {**batch, "input_ids": torch.nn.functional.pad(batch["input_ids"], (0, 40), value=pad)}
    with torch.no_grad():
        narrow_chosen, narrow_rejected = pair_rewards(model, batch)
        wide_chosen, wide_rejected = pair_rewards(model, wide)
    assert torch.allclose(narrow_chosen, wide_chosen, atol=1e-6) and torch.allclose(narrow_rejected, wide_rejected, atol=1e-6)
    assert not torch.allclose(narrow_chosen, narrow_rejected)  # the head separates the responses: the check can fail
