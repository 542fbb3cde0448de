"""One contract, every backend present: HF (lean and generate) always, HTTP through a real `slm-bench serve`, vLLM on a GPU."""

import pytest
import torch

from conftest import served_checkpoint
from slm_bench.core.errors import BadInput
from slm_bench.infer.http import HTTPSampler, RemoteError
from slm_bench.infer.sampling import HFSampler, SamplingParams, default_stop_ids


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    "The transformers model itself scores completions: the ground truth every backend must agree with."
    return HFSampler.from_checkpoint(tiny_checkpoint, mode="generate")


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with served_checkpoint(tiny_checkpoint) as url:
        yield url


def _vllm_available():
    if not torch.cuda.is_available():
        return "no GPU"
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "vllm is not installed (pip install -e '.[gpu]')"
    return None


@pytest.fixture(params=["hf-lean", "hf-generate", "http", "vllm"])
def sampler(request, tiny_checkpoint, tmp_path):
    kind = request.param
    if kind == "hf-lean":
        return HFSampler.from_checkpoint(tiny_checkpoint, mode="lean")
    if kind == "hf-generate":
        return HFSampler.from_checkpoint(tiny_checkpoint, mode="generate")
    if kind == "http":
        url = request.getfixturevalue("server")
        from transformers import AutoTokenizer
        return HTTPSampler(url, "tiny", tokenizer=AutoTokenizer.from_pretrained(tiny_checkpoint), max_context=96, retries=1, backoff=0.05)
    reason = _vllm_available()
    if reason:
        pytest.skip(f"vLLM backend: {reason}")
    from slm_bench.infer.vllm import VLLMSampler
    return VLLMSampler(str(tiny_checkpoint), dtype="float32", gpu_memory_utilization=0.2)


def prompt(reference, text="Tom has 7 apples and buys"):
    return reference.tokenizer(text)["input_ids"]


def test_seeded_reproducibility(sampler, reference):
    prompts = [prompt(reference), prompt(reference, "Tom has 21 apples")]
    params = SamplingParams(n=4, max_new_tokens=12, temperature=1.0, seed=7)
    first, again = sampler.generate(prompts, params), sampler.generate(prompts, params)
    assert [[c.token_ids for c in group] for group in first] == [[c.token_ids for c in group] for group in again]
    other = sampler.generate(prompts, SamplingParams(n=4, max_new_tokens=12, temperature=1.0, seed=8))
    assert [[c.token_ids for c in g] for g in other] != [[c.token_ids for c in g] for g in first]


def test_logprobs_equal_teacher_forced_score(sampler, reference):
    prompts = [prompt(reference), prompt(reference, "Tom has 3 apples and buys 9 more")]
    groups = sampler.generate(prompts, SamplingParams(n=3, max_new_tokens=10, temperature=1.0, top_p=0.9, seed=3))
    for p, group in zip(prompts, groups):
        truth = reference.score([p] * len(group), [c.token_ids for c in group])
        for completion, expected in zip(group, truth):
            assert len(completion.logprobs) == len(completion.token_ids) > 0
            assert completion.logprobs == pytest.approx(expected, abs=2e-4)
    # and the backend's own scorer agrees with the reference
    c = groups[0][0]
    assert sampler.score([prompts[0]], [c.token_ids])[0] == pytest.approx(reference.score([prompts[0]], [c.token_ids])[0], abs=2e-4)


def test_n_per_prompt_in_order(sampler, reference):
    prompts = [prompt(reference, f"Tom has {a} apples and buys") for a in (3, 11, 25)]
    groups = sampler.generate(prompts, SamplingParams(n=5, max_new_tokens=6, seed=1))
    assert [len(g) for g in groups] == [5, 5, 5]
    for p, group in zip(prompts, groups):  # each completion is scored as a continuation of its own prompt
        for c in group:
            assert c.logprobs == pytest.approx(reference.score([p], [c.token_ids])[0], abs=2e-4)


def test_stop_token_and_stop_string(sampler, reference):
    tok = reference.tokenizer
    greedy = sampler.generate([prompt(reference)], SamplingParams(temperature=0, max_new_tokens=20))[0][0]
    assert "apples" in greedy.text, greedy.text  # the trained model completes the sentence
    stop_id = greedy.token_ids[3]
    by_token = sampler.generate([prompt(reference)], SamplingParams(temperature=0, max_new_tokens=20, stop_token_ids=[stop_id]))[0][0]
    assert by_token.token_ids == greedy.token_ids[:greedy.token_ids.index(stop_id) + 1] and by_token.finish_reason == "stop"
    by_string = sampler.generate([prompt(reference)], SamplingParams(temperature=0, max_new_tokens=20, stop=["apples"]))[0][0]
    assert by_string.finish_reason == "stop" and "apples" not in by_string.text
    assert greedy.text.startswith(by_string.text) and greedy.text[len(by_string.text):].lstrip().startswith("apples")
    assert tok.eos_token_id not in by_string.token_ids


def test_empty_completions_and_immediate_stop(sampler, reference):
    empty = sampler.generate([prompt(reference)], SamplingParams(n=2, max_new_tokens=0))[0]
    assert [(c.token_ids, c.text, c.finish_reason) for c in empty] == [([], "", "length")] * 2
    everything = list(range(len(reference.tokenizer)))
    first = sampler.generate([prompt(reference)], SamplingParams(n=2, max_new_tokens=5, stop_token_ids=everything, seed=0))[0]
    assert all(len(c.token_ids) == 1 and c.finish_reason == "stop" for c in first)


def test_long_prompts(sampler, reference):
    context = 96
    near = (prompt(reference) * 20)[:context - 4]
    out = sampler.generate([near], SamplingParams(max_new_tokens=50, seed=0))[0][0]
    assert len(out.token_ids) <= 4
    if out.finish_reason == "length":
        assert len(out.token_ids) == 4
    too_long = (prompt(reference) * 20)[:context + 5]
    with pytest.raises((BadInput, RemoteError), match="context"):
        sampler.generate([too_long], SamplingParams(max_new_tokens=5))


def test_chat_prompts(sampler, reference):
    messages = [{"role": "user", "content": "Tom has 4 apples."}]
    out = sampler.generate([messages], SamplingParams(n=2, max_new_tokens=8, seed=0))[0]
    assert len(out) == 2 and all(c.finish_reason in ("stop", "length") for c in out)
    rendered = reference.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert out[0].logprobs == pytest.approx(reference.score([rendered], [out[0].token_ids])[0], abs=2e-4)


def test_lean_and_generate_agree(tiny_checkpoint, reference):
    lean = HFSampler.from_checkpoint(tiny_checkpoint, mode="lean")
    prompts = [prompt(reference), prompt(reference, "Tom has 19")]
    params = SamplingParams(n=3, max_new_tokens=10, seed=11, top_k=20)
    assert [[c.token_ids for c in g] for g in lean.generate(prompts, params)] == \
        [[c.token_ids for c in g] for g in reference.generate(prompts, params)]


@pytest.mark.parametrize("mode", ["lean", "generate"])
def test_samples_do_not_depend_on_batching(tiny_checkpoint, reference, mode):
    "Batches are sized by free memory, which differs between machines: a prompt's samples must not depend on them."
    prompts = [prompt(reference, f"Tom has {a} apples and buys") for a in (3, 11, 25, 7)]
    params = SamplingParams(n=3, max_new_tokens=8, seed=5)
    together = HFSampler.from_checkpoint(tiny_checkpoint, mode=mode).generate(prompts, params)
    one_by_one = HFSampler.from_checkpoint(tiny_checkpoint, mode=mode, max_batch_prompts=1).generate(prompts, params)
    assert [[c.token_ids for c in g] for g in together] == [[c.token_ids for c in g] for g in one_by_one]


def test_batches_follow_the_memory_budget(tiny_checkpoint):
    sampler = HFSampler.from_checkpoint(tiny_checkpoint)
    assert sampler._batches([10, 50, 20, 30], n=4, max_new=8) == [[0, 2, 3, 1]]  # one batch, similar lengths together
    two = 2.5 * sampler._bytes_per_prompt(40, 4, 8)  # room for two prompts of 40 tokens
    assert sampler._batches([40] * 5, n=4, max_new=8, budget=two) == [[0, 1], [2, 3], [4]]
    assert sampler._bytes_per_prompt(40, 16, 64) < HFSampler.from_checkpoint(tiny_checkpoint, mode="generate")._bytes_per_prompt(40, 16, 64)


def test_completion_text_keeps_its_leading_space(sampler, reference):
    "SentencePiece-style decoders drop a sequence's first space; a completion must be decoded as a continuation."
    tok = reference.tokenizer
    p = prompt(reference, "Tom has 7 apples and buys")
    c = sampler.generate([p], SamplingParams(temperature=0, max_new_tokens=6))[0][0]
    full = tok.decode(p + c.token_ids, skip_special_tokens=True)
    head = tok.decode(p, skip_special_tokens=True)
    assert c.text == full[len(head):] and c.text.startswith(" "), (c.text, full)


def test_content_seeds_make_a_sample_independent_of_its_batch(sampler, reference):
    "With content_seeds a prompt's samples depend on its tokens, not on its position or its neighbours."
    prompts = [prompt(reference, f"Tom has {a} apples and buys") for a in (3, 11, 25)]
    params = SamplingParams(n=3, max_new_tokens=8, seed=5, content_seeds=True)
    together = sampler.generate(prompts, params)
    alone = sampler.generate(prompts[2:], params)
    assert [c.token_ids for c in together[2]] == [c.token_ids for c in alone[0]]
    other_seed = sampler.generate(prompts[2:], SamplingParams(n=3, max_new_tokens=8, seed=6, content_seeds=True))
    assert [c.token_ids for c in other_seed[0]] != [c.token_ids for c in alone[0]]


@pytest.mark.parametrize("mode", ["lean", "generate"])
def test_content_seeded_sample_j_is_the_same_draw_however_requested(tiny_checkpoint, reference, mode):
    "Sample j of a prompt: asked for among 7 at once, or as 5 + 2 with first_sample, by either HF path."
    p = prompt(reference, "Tom has 9 apples and")
    base = dict(max_new_tokens=12, seed=3, top_k=50, content_seeds=True)
    all_seven = [c.token_ids for c in reference.generate([p], SamplingParams(n=7, **base))[0]]
    sampler = HFSampler.from_checkpoint(tiny_checkpoint, mode=mode)
    split = [c.token_ids for c in sampler.generate([p], SamplingParams(n=5, **base))[0]] + \
        [c.token_ids for c in sampler.generate([p], SamplingParams(n=2, first_sample=5, **base))[0]]
    assert split == all_seven
    assert len({tuple(t) for t in all_seven}) > 1  # really sampled, not one repeated draw


def test_first_sample_needs_content_seeds():
    with pytest.raises(BadInput, match="content_seeds"):
        SamplingParams(first_sample=3)


def test_finished_prompts_leave_the_lean_batch_without_changing_any_sample(tiny_checkpoint, reference):
    "Prompts that stop early are dropped from the lean loop's batch; the others' samples are exactly generate's."
    lean = HFSampler.from_checkpoint(tiny_checkpoint, mode="lean")
    prompts = [prompt(reference, text) for text in ("Tom has 3 apples and buys", "Tom", "Tom has 17 apples and buys 2", "Tom has")]
    for params in (SamplingParams(n=2, max_new_tokens=24, seed=2, stop=["more"]),
                   SamplingParams(n=2, max_new_tokens=24, seed=2, stop=["more"], content_seeds=True)):
        ours, theirs = lean.generate(prompts, params), reference.generate(prompts, params)
        assert [[c.token_ids for c in g] for g in ours] == [[c.token_ids for c in g] for g in theirs]
        lengths = [len(c.token_ids) for g in ours for c in g]
        assert min(lengths) < max(lengths)  # some prompts really did finish early


def test_rows_going_on_alone_draw_the_same_samples(tiny_checkpoint, reference, monkeypatch):
    "Content seeds, many samples of uneven length: rows go on alone once half are done, and every sample is the draw it was."
    p = [prompt(reference, "Tom has 9 apples and"), prompt(reference, "Tom has")]
    params = SamplingParams(n=24, max_new_tokens=40, seed=5, temperature=1.0, content_seeds=True, stop=["."])
    sampler = HFSampler.from_checkpoint(tiny_checkpoint, mode="lean")
    calls = []
    original = HFSampler._single_rows
    monkeypatch.setattr(HFSampler, "_single_rows", lambda self, *a, **kw: calls.append(len(a[0])) or original(self, *a, **kw))
    alone = [[c.token_ids for c in g] for g in sampler.generate(p, params)]
    sampler.single_rows_at = 0.0
    together = [[c.token_ids for c in g] for g in sampler.generate(p, params)]
    assert len(calls) == 1 and 0 < calls[0] <= 24  # once, with at most half of the 48 rows still running
    assert alone == together
    assert len({len(t) for g in alone for t in g}) > 3  # uneven lengths: the case it exists for


def test_checking_stop_strings_only_after_enders_stops_every_sample_where_checking_every_token_does(tiny_checkpoint, reference):
    "The lean loop looks for stop strings only after tokens that can end one (`stop_enders`); the samples are those of looking after every token."
    params = SamplingParams(n=16, max_new_tokens=24, seed=3, temperature=1.0, content_seeds=True, stop=[" more", "s ", "3"])
    prompts = [prompt(reference, text) for text in ("Tom has 3 apples and buys", "Tom has", "Tom has 17 apples")]
    filtered = HFSampler.from_checkpoint(tiny_checkpoint, mode="lean")
    everywhere = HFSampler.from_checkpoint(tiny_checkpoint, mode="lean")
    everywhere._stop_enders[tuple(params.stop)] = None  # None: look after every token
    ours = [[(c.token_ids, c.finish_reason) for c in g] for g in filtered.generate(prompts, params)]
    theirs = [[(c.token_ids, c.finish_reason) for c in g] for g in everywhere.generate(prompts, params)]
    assert ours == theirs
    assert 0 < len(filtered.enders(params.stop)) < len(reference.tokenizer)  # the filter skips tokens
    stop_ids = default_stop_ids(reference.tokenizer, params)
    by_string = sum(reason == "stop" and ids[-1] not in stop_ids for g in ours for ids, reason in g)
    assert by_string >= 8  # many samples stopped on a string, not on a stop token


def test_fused_and_eager_steps_draw_the_same_samples(tiny_checkpoint, reference):
    "The fused decode kernels change no sample: one sample per prompt, and many with prompts finishing early and rows going on alone."
    fused = HFSampler.from_checkpoint(tiny_checkpoint, mode="lean", attention="fused")
    eager = HFSampler.from_checkpoint(tiny_checkpoint, mode="lean", attention="eager")
    assert (fused.lean.fused, eager.lean.fused) == (True, False)
    prompts = [prompt(reference, text) for text in ("Tom has 3 apples and buys", "Tom", "Tom has 17 apples and buys 2", "Tom has")]
    for params in (SamplingParams(n=1, max_new_tokens=24, seed=3, top_k=20),
                   SamplingParams(n=6, max_new_tokens=24, seed=2, stop=["more"], content_seeds=True)):
        ours, theirs = fused.generate(prompts, params), eager.generate(prompts, params)
        assert [[c.token_ids for c in g] for g in ours] == [[c.token_ids for c in g] for g in theirs]
        assert [c.logprob for g in ours for c in g] == pytest.approx([c.logprob for g in theirs for c in g], abs=1e-4)


def test_the_fused_pick_draws_what_the_torch_pick_draws_on_any_thread_count():
    "PromptNoise: the compiled Gumbel-max pick against its torch ops, and uniforms drawn on 2 threads against 1 (the same per-prompt streams)."
    from slm_bench.infer.sampling import PromptNoise

    scores = torch.randn(12 * 8, 301, generator=torch.Generator().manual_seed(5))
    scores[::3, 40:] = float("-inf")  # top-k masked rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = PromptNoise(7, range(12)).uniforms(scores.shape)
        torch_picks = PromptNoise(7, range(12), fused=False).pick(scores)
        torch.set_num_threads(2)
        assert torch.equal(PromptNoise(7, range(12)).uniforms(scores.shape), one_thread)
        fused_picks = PromptNoise(7, range(12)).pick(scores)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(fused_picks, torch_picks)
    assert torch.equal(torch_picks, (scores - one_thread.clamp_min(1e-20).log().neg().log()).argmax(-1))
    assert (torch_picks[::3] < 40).all()


def test_the_fused_inverse_cdf_pick_draws_what_its_torch_ops_draw():
    "SampleNoise (content seeds, PTS's rollouts): the compiled inverse-CDF pick against softmax, cumsum and searchsorted, over several steps."
    from slm_bench.infer.sampling import SampleNoise

    g = torch.Generator().manual_seed(6)
    prompts = [[5, 6, 7], [9], [11, 12]]
    fused, plain = SampleNoise(4, prompts, 8, fused=True), SampleNoise(4, prompts, 8, fused=False)
    drawn = []
    for step in range(5):
        scores = torch.randn(24, 301, generator=g) * (1 + step)  # flatter and sharper rows
        scores[::4, 30:] = float("-inf")
        picks = fused.pick(scores)
        assert torch.equal(picks, plain.pick(scores)), step
        assert (picks[::4] < 30).all()
        drawn.append(picks)
    assert len({tuple(p.tolist()) for p in drawn}) == 5  # the steps draw afresh
