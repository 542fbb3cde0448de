"""The lean decoder computes the transformers model's own logits, at prefill and at every decode step."""
import pytest
import torch

from slm_bench.infer.lean import LeanDecoder, lean_support
from slm_bench.lm.models import create_model, get_preset


@pytest.mark.parametrize("attention", ["fused", "eager"])
@pytest.mark.parametrize("name, kv_heads", [("llama-0.5m", 4), ("llama-0.5m", 2), ("llama-0.5m", 1), ("phi-0.5m", 2), ("llama-2m", 2)])
def test_decode_steps_match_the_full_forward(name, kv_heads, attention):
    "Head size 16 (the kernel's generic loop) and 32 (its compiled-in size), MHA, GQA and MQA, Llama and Phi-3."
    model = create_model(get_preset(name, num_kv_heads=kv_heads, vocab_size=97, rope_theta=250_000.0)).eval()
    lean = LeanDecoder(model, attention=attention)
    assert (lean.fused, lean.fused_step) == (attention == "fused", attention == "fused")  # rotary over whole heads: every part fused
    assert_steps_match(model, lean, name)


def test_partial_rotary_keeps_the_fused_attention_and_rotates_in_torch():
    "Phi-3 with rotary over half of each head: `rope_qkv` (whole heads) does not apply, so the step runs its torch elementwise path around the fused attention."
    from transformers import Phi3ForCausalLM

    config = create_model(get_preset("phi-0.5m", vocab_size=97)).config
    config.rope_parameters["partial_rotary_factor"] = 0.5
    model = Phi3ForCausalLM(config).eval()
    lean = LeanDecoder(model, attention="fused")
    assert (lean.fused, lean.fused_step, 2 * lean.inv_freq.numel(), lean.head_dim) == (True, False, 8, 16)
    assert_steps_match(model, lean, "phi-0.5m, half rotary")


def assert_steps_match(model, lean, name):
    "Prefill and six decode steps of 3 samples for 2 left-padded prompts give the full forward's last logits on every row."
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]  # different lengths: left padding
    n, steps = 3, 6
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    logits, prompt_cache = lean.prefill(ids, mask)
    cache = lean.new_cache(len(prompts) * n, steps, n)
    assert cache[0][0].shape == ((len(prompts), kv_heads_of(model), steps, lean.head_dim, n) if lean.fused  # time-major, samples innermost
                                 else (len(prompts) * n, kv_heads_of(model), steps, lean.head_dim))
    g = torch.Generator().manual_seed(0)
    sequences = [list(p) for p in prompts for _ in range(n)]
    logits = logits.repeat_interleave(n, 0)
    positions = mask.sum(-1).repeat_interleave(n)
    for t in range(steps):
        with torch.no_grad():
            for row, seq in enumerate(sequences):
                reference = model(torch.tensor([seq])).logits[0, -1]
                assert torch.allclose(logits[row], reference, atol=1e-5), (name, t, row)
        token = torch.randint(3, 97, (len(sequences),), generator=g)
        for row, seq in enumerate(sequences):
            seq.append(int(token[row]))
        logits = lean.step(token, positions + t, prompt_cache, mask, cache, t, n)


def kv_heads_of(model) -> int:
    return model.config.num_key_value_heads


def test_weights_changed_in_place_are_picked_up():
    model = create_model(get_preset("llama-0.5m", vocab_size=50)).eval()
    lean = LeanDecoder(model)
    ids, mask = torch.tensor([[3, 4, 5]]), torch.ones(1, 3, dtype=torch.long)
    before, _ = lean.prefill(ids, mask)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(3.0)  # what an optimizer step does: in place
    after, _ = lean.prefill(ids, mask)
    with torch.no_grad():
        assert torch.allclose(after[0], model(ids).logits[0, -1], atol=1e-5) and not torch.allclose(before, after)


def test_unsupported_models_are_named():
    from transformers import GPT2Config, GPT2LMHeadModel
    assert "GPT2LMHeadModel is not one of" in lean_support(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)))
