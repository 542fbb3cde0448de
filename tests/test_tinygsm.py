"""TinyGSM pieces: verifier training data (sampling → execution → labels, repeats dropped) with a real sandbox."""
import pytest
from transformers import AutoTokenizer

from slm_bench.lm.packing import IGNORE
from slm_bench.infer.sampling import Completion
from slm_bench.evals.sandbox import Sandbox
from slm_bench.evals.tasks import Problem
from slm_bench.methods.tinygsm import label_solutions

PROBLEMS = [Problem("a", 0, "Ann has 3 pens and buys 4 more. How many pens?", 7), Problem("b", 1, "Bo has 9 cats and gives away 2. How many cats?", 7)]


class ScriptedGenerator:
    "Returns fixed program bodies (a right one and a wrong one per question), so the labels have known answers."

    def __init__(self, tokenizer, bodies):
        self.tokenizer, self.bodies = tokenizer, bodies

    def generate(self, prompts, params):
        groups = []
        for prompt in prompts:
            question = self.tokenizer.decode(prompt)
            key = "a" if "Ann" in question else "b"
            texts = [self.bodies[key][i % len(self.bodies[key])] for i in range(params.n)]
            groups.append([Completion(self.tokenizer(t, add_special_tokens=False)["input_ids"], t, [], "stop") for t in texts])
        return groups


@pytest.fixture(scope="module")
def box():
    with Sandbox() as sandbox:
        yield sandbox


def test_labels_come_from_execution_and_repeats_are_dropped(tiny_checkpoint, box):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    bodies = {"a": ["    return 3 + 4\n", "    return 3 * 4\n"], "b": ["    return 9 - 2\n", "    return 9 - 2\n", "    return 9 + 2\n"]}
    generator = ScriptedGenerator(tokenizer, bodies)
    # 3 samples per question at each of 2 temperatures: 12 samples, of which a keeps 2 distinct and b keeps 2 distinct
    rows, repeats = label_solutions(generator, PROBLEMS, 3, [0.5, 0.7], box, seen=set())
    assert repeats == 8 and len(rows) == 4
    assert [(r["label"], r["temperature"]) for r in rows] == [(1, 0.5), (0, 0.5), (1, 0.5), (0, 0.5)]
    rows, repeats = label_solutions(generator, PROBLEMS, 3, [0.5, 0.7], box, seen=None)
    assert repeats == 0 and len(rows) == 12
    assert [r["label"] for r in rows[:6]] == [1, 0, 1, 1, 1, 0]  # a: +, -, +   b: +, +, -
    example = rows[1]["example"]  # token-level: every solution token carries the 0 label, the prompt none
    solution = [y for y in example["labels"] if y != IGNORE]
    assert solution == [0] * len(tokenizer("    return 3 * 4\n", add_special_tokens=False)["input_ids"])


def test_a_shared_seen_set_drops_repeats_across_calls(tiny_checkpoint, box):
    "Several checkpoints feed one verifier: a solution already labelled from one is not added again from another."
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    generator = ScriptedGenerator(tokenizer, {"a": ["    return 7\n"], "b": ["    return 7\n"]})
    seen = set()
    first, _ = label_solutions(generator, PROBLEMS, 2, [1.0], box, seen=seen)
    second, repeats = label_solutions(generator, PROBLEMS, 2, [1.0], box, seen=seen)
    assert len(first) == 2 and second == [] and repeats == 4


class RecordingGenerator(ScriptedGenerator):
    "A scripted generator that records the (n, temperature, seed) of every call."

    def __init__(self, tokenizer, bodies):
        super().__init__(tokenizer, bodies)
        self.calls = []

    def generate(self, prompts, params):
        self.calls.append((params.n, params.temperature, params.seed))
        return super().generate(prompts, params)


def test_candidates_are_split_over_tinygsms_temperatures(tiny_checkpoint):
    from slm_bench.methods.tinygsm import mixed_temperature_samples

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    generator = RecordingGenerator(tokenizer, {"a": ["    return 7\n"], "b": ["    return 7\n"]})
    groups = mixed_temperature_samples(generator, PROBLEMS, 5, [0.5, 0.7], seed=10)
    assert generator.calls == [(3, 0.5, 10), (2, 0.7, 11)]  # the first temperature takes the remainder, each its own seed
    assert [len(g) for g in groups] == [5, 5]
    generator.calls = []
    mixed_temperature_samples(generator, PROBLEMS, 4, 1.0, seed=3)
    assert generator.calls == [(4, 1.0, 3)]


def test_stage_defaults_follow_tinygsm():
    "Candidates for the verifier's training data and for test are drawn at the same mix, TinyGSM's 0.5 and 0.7."
    from pathlib import Path

    from slm_bench.pipeline.stages import discover_stages

    stages = discover_stages(Path(__file__).resolve().parents[1] / "nbs" / "stages")
    default = lambda stage, name: stages[stage].params[name].default
    assert default("verifier", "temperatures") == default("evaluate", "temperatures") == default("grid", "temperatures") == [0.5, 0.7]
    assert default("verifier", "level") == "token" and default("verifier", "head_only") is False and default("verifier", "from_scratch") is False
    assert default("evaluate", "samples") == default("grid", "samples") == 8
    assert default("synth", "n_verifier") >= default("verifier", "questions")  # the verifier's questions exist
    assert default("synth", "verifier_irrelevant_rate") == 0.0  # GSM8K train questions are plain
    assert "pretrain" in stages["grid"].inputs  # the smaller pair is pretrained like the pipeline's


def test_pair_recipe_takes_exactly_the_stage_settings():
    from slm_bench.core.errors import BadInput
    from slm_bench.methods.tinygsm import PairRecipe

    pretrain = {"steps": 200, "micro_batch_size": 16, "lr": 3e-3, "warmup_steps": 25, "hidden_size": 128, "num_layers": 5, "preset": "llama-2m"}
    sft = {"steps": 650, "micro_batch_size": 16, "seq_len": 384, "lr": 3e-3, "warmup_steps": 30, "checkpoint_at": [220, 440], "seed": 0}
    verifier = {k: i for i, k in enumerate(PairRecipe.KEYS["verifier"])}
    recipe = PairRecipe.from_parameters(pretrain, sft, verifier, seed=4)
    assert recipe.pretrain == {"steps": 200, "micro_batch_size": 16, "lr": 3e-3, "warmup_steps": 25}  # the shape is not part of it
    assert recipe.sft == {k: v for k, v in sft.items() if k != "seed"} and recipe.verifier == verifier
    assert recipe.as_dict() == {"pretrain": recipe.pretrain, "sft": recipe.sft, "verifier": verifier, "seed": 4}
    with pytest.raises(BadInput, match="the sft stage's parameters lack seq_len, checkpoint_at"):
        PairRecipe.from_parameters(pretrain, {k: v for k, v in sft.items() if k not in ("seq_len", "checkpoint_at")}, verifier)
