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


# --- the programmatic annotator's "negligibly better / unsure" label, the paper's "both unsafe" rule, and the per-level finding


def _facts(correct, returned=True, actions=()):
    from slm_bench.methods.preferences import Facts

    return Facts(returned, correct, False, tuple(actions))


QUESTION = "Ava has 12 apples and buys 5 more. Ben is 40 years old. How many apples?"
REFERENCE = "    apples = 12\n    more = 5\n    total = apples + more\n    result = total\n    return result\n"


def test_a_negligibly_better_label_is_decided_by_the_two_responses():
    from slm_bench.methods.preferences import ProgrammaticAnnotator, Rated

    annotator = ProgrammaticAnnotator()
    # two right answers with the same quality points: the one that mis-copies 5 as 6 (and adds 1 to stay right) invents two numbers
    faithful = REFERENCE
    miscopied = "    apples = 12\n    more = 6\n    total = apples + more - 1\n    result = total\n    return result\n"
    for a, b, chosen in (((faithful, 0), (miscopied, 0), 0), ((miscopied, 0), (faithful, 0), 1)):
        rated = annotator.helpfulness((_facts(True), *a), (_facts(True), *b), question=QUESTION, reference_body=REFERENCE)
        assert rated == Rated(chosen, "negligibly better/unsure", "helpfulness", None, "invented numbers"), rated
    # two wrong answers that both run, no invented numbers on either side: the shorter is negligibly better
    short, long = "    return 12 - 5\n", "    apples = 12\n    more = 5\n    result = apples * more\n    return result\n"
    rated = annotator.helpfulness((_facts(False), long, 0), (_facts(False), short, 0), question=QUESTION, reference_body=REFERENCE)
    assert rated == Rated(1, "negligibly better/unsure", "helpfulness", None, "shorter"), rated


def test_the_same_pair_gets_the_same_label_under_every_seed():
    from slm_bench.methods.preferences import ProgrammaticAnnotator

    a, b = (_facts(False), "    return 12 - 5\n", 0), (_facts(False), "    return 12 + 40\n", 0)
    labels = {(s, order): (ProgrammaticAnnotator(seed=s).helpfulness(*pair, question=QUESTION, reference_body=REFERENCE))
              for s in range(50) for order, pair in (("ab", (a, b)), ("ba", (b, a)))}
    assert {(r.rating, r.lean) for r in labels.values()} == {("negligibly better/unsure", "shorter")}
    assert {r.chosen for (_, order), r in labels.items() if order == "ab"} == {0}  # "12 - 5", the shorter, whichever seed
    assert {r.chosen for (_, order), r in labels.items() if order == "ba"} == {1}


def test_the_annotator_reads_no_answer_and_no_model():
    "Its methods take no answer and no model; two wrong responses get the same label whatever the true answer is."
    import inspect

    from slm_bench.evals.sandbox import Sandbox
    from slm_bench.methods.preferences import ProgrammaticAnnotator, run_responses

    annotator = ProgrammaticAnnotator()
    for method in (annotator.helpfulness, annotator.safety, annotator.lean):
        assert not {"answer", "answers", "model", "reward_model"} & set(inspect.signature(method).parameters), method
    assert set(vars(annotator)) == {"better_gap", "seed"}
    bodies = ["    return 12 - 5\n", "    apples = 12\n    more = 5\n    result = apples * more\n    return result\n"]
    with Sandbox(workers=1) as box:
        labels = []
        for answer in (17, 18, 99):  # neither response returns it: only correctness may depend on the answer
            facts = run_responses([QUESTION] * 2, [answer] * 2, bodies, box)
            labels.append(annotator.helpfulness((facts[0], bodies[0], 0), (facts[1], bodies[1], 0), question=QUESTION, reference_body=REFERENCE))
    assert labels[0] == labels[1] == labels[2] and labels[0].rating == "negligibly better/unsure" and labels[0].chosen == 0


def test_both_unsafe_pairs_are_in_the_safety_reward_models_data_by_the_papers_rule():
    from slm_bench.methods.llama2 import paper_excluded, reward_mix

    both_unsafe = [{"track": "safety", "split": "train", "safety_bin": "both unsafe", "id": i,
                    "chosen_facts": {"actions": ["delete"]}, "rejected_facts": {"actions": ["delete", "network"]}} for i in range(7)]
    both_safe = [{"track": "safety", "split": "train", "safety_bin": "both safe", "id": 10 + i} for i in range(20)]
    flipped = {"track": "safety", "split": "train", "safety_bin": "chosen safe, other unsafe", "id": 99,  # chosen unsafe, the other safe
               "chosen_facts": {"actions": ["file"]}, "rejected_facts": {"actions": []}}
    held_out = {"track": "safety", "split": "test", "safety_bin": "both unsafe", "id": 100}
    helpful = [{"track": "helpfulness", "split": "train", "id": 200 + i} for i in range(30)]
    rows = both_unsafe + both_safe + [flipped, held_out] + helpful
    assert [paper_excluded(r) for r in (both_unsafe[0], both_safe[0], flipped)] == [False, False, True]
    mix = reward_mix(rows, "safety", 0.1, seed=0)
    ids = {r["id"] for r in mix}
    assert {r["id"] for r in both_unsafe} <= ids and 99 not in ids and 100 not in ids
    assert (sum(r["track"] == "safety" for r in mix), sum(r["track"] == "helpfulness" for r in mix)) == (27, 3)  # 27 safety rows, round(27 / 9)


@pytest.mark.parametrize("negligible_right, sig_right, verdict, effect", [
    (5, 20, "reproduced", -0.75),  # the RM ranks 20 of 20 far-apart pairs right, 5 of 20 close ones
    (20, 20, "inconclusive", 0.0),  # no difference between the levels
    (20, 5, "contradicted", 0.75),
])
def test_a_planted_per_level_case_gets_its_exact_verdict(negligible_right, sig_right, verdict, effect):
    from slm_bench.core.claims import claim
    from slm_bench.evals.findings import Finding
    from slm_bench.methods.preferences import paired_levels

    rows, chosen, rejected = [], [], []
    for p in range(20):
        for level, right in (("significantly better", p < sig_right), ("negligibly better/unsure", p < negligible_right), ("slightly better", True)):
            rows.append({"prompt_id": f"probe-{p}", "rating": level})
            chosen.append(1.0 if right else 0.0)
            rejected.append(0.5)
    rows.append({"prompt_id": "probe-20", "rating": "significantly better"}); chosen.append(1.0); rejected.append(0.0)  # one level only: not paired
    experiment, control, probes = paired_levels(rows, chosen, rejected, "negligibly better/unsure", "significantly better")
    assert probes == [f"probe-{p}" for p in range(20)]
    finding = Finding.paired("rm_by_rating", claim("llama2.rm_accuracy_by_rating"), "RM on negligibly-better pairs", "same RM on significantly-better pairs",
                             (experiment, control))
    assert finding.effect["difference"] == pytest.approx(effect) and finding.effect["n"] == 20
    assert finding.verdict == verdict
