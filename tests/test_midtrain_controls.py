"Midtraining's controls (issue 54): the RoPE-base control differs from the experiment in the base alone; training rows are not in the recall test's format."
import random
import re

import pytest


@pytest.fixture(scope="module")
def tok():
    from slm_bench.lm.tokenizer import train_tokenizer
    from slm_bench.methods.midtrain import NEUTRAL_FILLER

    texts = list(NEUTRAL_FILLER) * 5 + ["Ava has 12 apples. She gets 5 more. Then she eats 3. How many apples does Ava have now?"] * 5
    return train_tokenizer(texts + ["    start = 12\n    more = 5\n    eaten = 3\n    result = start + more - eaten\n    return result\n"] * 5, vocab_size=300)


QUESTION = "Ava has 12 apples. She gets 5 more. Then she eats 3. How many apples does Ava have now?"
RECORD = {"id": "a", "question": QUESTION, "program": "def simple_math_problem() -> int:\n    \"\"\"\n    " + QUESTION + "\n    \"\"\"\n"
          "    start = 12\n    more = 5\n    eaten = 3\n    result = start + more - eaten\n    return result\n"}


def test_the_control_keeps_the_original_rope_base_and_nothing_else_differs(tok):
    "extend_context(model, factor) keeps the model's own base (10,000); with 250K only rope_theta differs between the two configs."
    from slm_bench.lm.models import create_model, get_preset
    from slm_bench.methods.midtrain import extend_context

    small = create_model(get_preset("llama-0.5m", vocab_size=len(tok), max_position_embeddings=128), pad_token_id=tok.pad_token_id)
    experiment, control = extend_context(small, 4, 250_000), extend_context(small, 4)
    assert experiment.config.rope_parameters["rope_theta"] == 250_000.0
    assert control.config.rope_parameters["rope_theta"] == small.config.rope_parameters["rope_theta"] == 10_000.0
    e, c = experiment.config.to_dict(), control.config.to_dict()
    assert {k for k in e.keys() | c.keys() if e.get(k) != c.get(k)} == {"rope_parameters"}
    assert {k for k in e["rope_parameters"] if e["rope_parameters"][k] != c["rope_parameters"][k]} == {"rope_theta"}
    assert e["max_position_embeddings"] == c["max_position_embeddings"] == 512


def test_training_rows_hold_no_test_filler(tok):
    "needle_examples (every training example, one run or spread) uses only the training half of the filler; recall_inputs only the test half, in one run after the first sentence."
    from slm_bench.evals.tasks import tinygsm_prompt
    from slm_bench.methods.midtrain import TEST_FILLER, TRAIN_FILLER, needle_examples, recall_inputs, stretch

    assert set(TRAIN_FILLER).isdisjoint(TEST_FILLER) and (len(TRAIN_FILLER), len(TEST_FILLER)) == (70, 6)
    plain = len(tok(tinygsm_prompt(QUESTION))["input_ids"])
    made = needle_examples(tok, [RECORD] * 4, [plain + 200], seed=1) + needle_examples(tok, [RECORD] * 4, [plain + 200], seed=1, spread=True)
    squash = lambda s: s.replace(" ", "")
    for example in made:
        prompt = squash(tok.decode([t for t, label in zip(example["input_ids"], example["labels"]) if label == -100]))
        assert not any(squash(s) in prompt for s in TEST_FILLER)
        assert any(squash(s) in prompt for s in TRAIN_FILLER)
    spread = stretch(QUESTION, plain + 200, tok, random.Random(1), TRAIN_FILLER, spread=True)
    parts = re.split(r"(?<=[.?!]) ", spread)
    own = [i for i, p in enumerate(parts) if p not in TRAIN_FILLER]
    assert [parts[i] for i in own] == re.split(r"(?<=[.?!]) ", QUESTION)
    assert all(b - a > 1 for a, b in zip(own, own[1:]))  # filler in every gap between two sentences
    test_text = squash(tok.decode(recall_inputs(tok, [RECORD], plain + 200)[0][0]))
    assert not any(squash(s) in test_text for s in TRAIN_FILLER)
    test_prompt = stretch(QUESTION, plain + 200, tok, random.Random(0))
    assert test_prompt.startswith("Ava has 12 apples. ") and test_prompt.endswith(" She gets 5 more. Then she eats 3. How many apples does Ava have now?")


@pytest.mark.parametrize("experiment, control, verdict", [
    ([1, 0] * 20, [1, 0] * 20, "inconclusive"),  # identical arms: zero effect
    ([1] * 30 + [0] * 10, [1] * 5 + [0] * 35, "reproduced"),
    ([0] * 40, [1] * 20 + [0] * 20, "contradicted"),
])
def test_the_rope_base_finding_flips_with_planted_scores(experiment, control, verdict):
    "Raised base against the original base through the ledger: equal arms give exactly 0, a planted gap its verdict."
    from slm_bench.core.claims import claim
    from slm_bench.evals.findings import Finding

    finding = Finding.paired("planted", claim("phi4.midtrain_rope_base"), "raised base", "original base", (experiment, control))
    assert finding.verdict == verdict
    if experiment == control:
        assert (finding.effect["difference"], finding.effect["ci_low"], finding.effect["ci_high"]) == (0.0, 0.0, 0.0)
