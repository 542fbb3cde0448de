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
