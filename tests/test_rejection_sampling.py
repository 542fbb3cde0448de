"""Llama 2's rejection-sampling iteration: the temperature re-tuned by best-of-K reward on some prompts and measured on others."""
import pytest

from slm_bench.core.errors import BadInput
from slm_bench.evals.tasks import tinygsm_prompt
from slm_bench.infer.sampling import HFSampler
from slm_bench.lm.models import create_model, get_preset
from slm_bench.lm.tokenizer import train_tokenizer
from slm_bench.methods.rejection_sampling import best_sample_records, choose_temperature, retune_temperature, rs_iteration


class Prompt:
    def __init__(self, i):
        self.id, self.question, self.track = f"p{i}", f"Ava has {i} apples. How many?", "helpfulness"


@pytest.fixture(scope="module")
def sampler():
    tokenizer = train_tokenizer([tinygsm_prompt(f"Ava has {i} apples. How many?") + f"    return {i}\n" for i in range(60)], vocab_size=300)
    return HFSampler(create_model(get_preset("llama-0.5m", vocab_size=len(tokenizer)), seed=0).eval(), tokenizer)


def test_choose_temperature_takes_the_highest_mean_best_of_k_and_the_lower_of_equals():
    assert choose_temperature({0.3: [0.2, 0.4], 0.7: [0.5, 0.3], 1.0: [0.9, 0.1]}) == 1.0  # means 0.3, 0.4, 0.5
    assert choose_temperature({0.3: [0.6], 1.0: [0.6]}) == 0.3
    with pytest.raises(BadInput, match="at least one prompt"):
        choose_temperature({0.5: []})


def test_retuning_chooses_on_even_prompts_only_and_reports_the_odd_ones(sampler):
    # per temperature, one best-of-K reward per prompt (the scorer is called once per temperature, in grid order): on the
    # even-numbered prompts 0.3 wins (0.9 against 0.5), on the odd ones 1.0 would (0.8 against 0.1)
    planted = iter([[0.9, 0.1, 0.9, 0.1], [0.5, 0.8, 0.5, 0.8]])
    scorer = lambda groups: [[best] + [0.0] * (len(g) - 1) for best, g in zip(next(planted), groups)]
    tuned = retune_temperature(sampler, [Prompt(i) for i in range(4)], 3, [0.3, 1.0], scorer, max_new_tokens=4)
    assert tuned["chosen"] == 0.3
    assert tuned["choose_means"] == pytest.approx({0.3: 0.9, 1.0: 0.5})
    assert tuned["measure_best"] == {0.3: [0.1, 0.1], 1.0: [0.8, 0.8]}
    with pytest.raises(BadInput, match="at least 2 prompts"):
        retune_temperature(sampler, [Prompt(0)], 3, [1.0], scorer)


def test_an_iteration_keeps_each_prompts_highest_reward_sample_drawn_at_the_chosen_temperature(sampler):
    length = lambda prompts: (lambda groups: [[len(c.token_ids) for c in g] for g in groups])
    it = rs_iteration(sampler, [Prompt(i) for i in range(3)], [Prompt(i) for i in range(3, 7)], length, 4, [0.5, 1.0], iteration=2, max_new_tokens=6)
    assert [it["best"][f"p{i}"]["reward"] for i in range(3)] == [max(r) for r in it["rc"]]
    assert {e["iteration"] for e in it["best"].values()} == {2}
    assert it["temperatures"] == [[it["tuned"]["chosen"]] * 4] * 3
    records = best_sample_records(it["best"])
    assert [r["question"] for r in records] == [Prompt(i).question for i in range(3)]
    assert records[1]["program"] == tinygsm_prompt(Prompt(1).question) + it["best"]["p1"]["sample"][1]
