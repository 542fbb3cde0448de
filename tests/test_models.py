"""Model presets, counts, HF-format round trips, tokenizer rules and vocab/embedding agreement."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slm_bench.core.errors import BadInput
from slm_bench.lm.models import PAPER_FFN_MULTIPLIER, add_tokens, build_config, check_vocab, count_parameters, create_model, flops_per_token, get_preset, load_checkpoint, save_checkpoint, with_kv_heads
from slm_bench.lm.tokenizer import IM_END, IM_START, PAD, train_tokenizer

CORPUS = [f"Tom has {a} apples and buys {b} more, so he has {a + b} apples. Natalia sold {a * 2} clips in April."
          for a in range(3, 40) for b in range(2, 9)]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CORPUS, vocab_size=400)


def test_presets_shape_and_attention_kinds():
    llama, phi = create_model("llama-0.5m"), create_model("phi-0.5m")
    assert type(llama).__name__ == "LlamaForCausalLM" and type(phi).__name__ == "Phi3ForCausalLM"
    assert phi.config.sliding_window is None  # phi-4: full attention
    assert build_config(get_preset("phi4")).rope_parameters["rope_theta"] == 250_000
    assert get_preset("llama2-70b").attention == "GQA" and get_preset("llama2-7b").attention == "MHA"
    mqa = create_model(get_preset("llama-2m", num_kv_heads=1))
    assert mqa.model.layers[0].self_attn.k_proj.weight.shape == (32, 128)  # one KV head of head_dim 32
    with pytest.raises(BadInput, match="unknown model preset 'gpt-5'"):
        get_preset("gpt-5")
    with pytest.raises(BadInput, match="must divide"):
        get_preset("llama-2m", num_kv_heads=3)


@pytest.mark.parametrize("name", ["llama-0.5m", "llama-2m", "phi-2m"])
@pytest.mark.parametrize("kv_heads", [None, 2, 1])
def test_parameter_count_matches_the_instantiated_model(name, kv_heads):
    preset = get_preset(name) if kv_heads is None else with_kv_heads(get_preset(name), kv_heads)
    assert count_parameters(preset)["total"] == sum(p.numel() for p in create_model(preset).parameters())


def test_matched_ffn_keeps_parameters_and_paper_multipliers():
    base = get_preset("llama-8m")
    total = count_parameters(base)["total"]
    for g in (4, 2, 1):
        matched = with_kv_heads(base, g)
        assert matched.intermediate_size > base.intermediate_size
        assert abs(count_parameters(matched)["total"] - total) <= 1.5 * base.hidden_size * base.num_layers
    assert with_kv_heads(base, 2, "paper").intermediate_size == round(base.intermediate_size * PAPER_FFN_MULTIPLIER["GQA"])
    assert with_kv_heads(base, 1, "paper").intermediate_size == round(base.intermediate_size * 1.33)
    # hand count: removing 8-1 KV heads of 32 dims from d=256 frees 2*256*7*32 weights per layer = 3*256*dF
    assert with_kv_heads(base, 1).intermediate_size == base.intermediate_size + round(2 * 256 * 7 * 32 / (3 * 256))


def test_flops_per_token_by_hand():
    p = get_preset("llama-0.5m")  # d=64, 4 layers, ffn 172, vocab 2048
    weights = 4 * (4 * 64 * 64 + 3 * 64 * 172) + 2048 * 64
    flops = flops_per_token(p, context=128)
    assert flops["forward"] == 2 * weights + 2 * 4 * 128 * 64
    assert flops["train"] == 3 * flops["forward"]


def test_tokenizer_rules(tokenizer):
    ids = tokenizer("It costs 1234 dollars — ünïcode 日本", add_special_tokens=False)["input_ids"]
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert [p for p in pieces if p.strip("▁").isdigit()] == ["1", "2", "3", "4"]
    assert tokenizer.unk_token_id not in ids and any(p.startswith("<0x") for p in pieces)
    assert tokenizer.decode(ids) == "It costs 1234 dollars — ünïcode 日本"
    for token in (IM_START, IM_END, "<|im_sep|>", PAD):
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1


def test_assistant_mask_from_chat_template(tokenizer):
    messages = [{"role": "user", "content": "How many apples?"}, {"role": "assistant", "content": "He has 12 apples."}]
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    answer = [i for i, m in zip(ids, mask) if m]
    assert tokenizer.decode(answer, skip_special_tokens=False) == "He has 12 apples.<|im_end|>"
    assert tokenizer.decode([i for i, m in zip(ids, mask) if not m], skip_special_tokens=False).startswith("<|im_start|>user")


def test_checkpoint_round_trip(tokenizer, tmp_path):
    model = create_model(get_preset("llama-0.5m", vocab_size=len(tokenizer)), eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    folder = save_checkpoint(model, tokenizer, tmp_path / "ckpt")
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no staging folder left behind
    loaded = AutoModelForCausalLM.from_pretrained(folder)  # plain transformers, nothing of ours
    again = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([tokenizer("Tom has 12 apples")["input_ids"]])
    assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert again("Tom has 12 apples")["input_ids"] == ids[0].tolist()
    assert loaded.generation_config.eos_token_id == tokenizer.eos_token_id
    assert again.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False)
    model2, tok2 = load_checkpoint(folder)
    assert torch.equal(model2(ids).logits, loaded(ids).logits) and len(tok2) == len(tokenizer)


def test_failed_save_keeps_the_previous_checkpoint(tokenizer, tmp_path):
    model = create_model(get_preset("llama-0.5m", vocab_size=len(tokenizer)))
    folder = save_checkpoint(model, tokenizer, tmp_path / "ckpt")
    before = (folder / "model.safetensors").read_bytes()

    class Exploding:
        def __getattr__(self, name):
            raise RuntimeError("disk full")
    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(model, Exploding(), folder)
    assert (folder / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_bad_checkpoints(tmp_path):
    with pytest.raises(BadInput, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInput, match="not an HF-format checkpoint: no config.json"):
        load_checkpoint(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(BadInput, match="no weights"):
        load_checkpoint(tmp_path / "empty")
    (tmp_path / "file.bin").write_text("x")
    with pytest.raises(BadInput, match="is a file"):
        load_checkpoint(tmp_path / "file.bin")


def test_vocab_mismatch_and_orca2_resize():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    base = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({f"w{i}": i for i in range(32000)}, unk_token="w0")))
    assert len(base) == 32000
    model = create_model(get_preset("llama-0.5m", vocab_size=32000, hidden_size=8, num_heads=2, num_kv_heads=2, num_layers=1, intermediate_size=16))
    check_vocab(model, base)
    old = model.get_input_embeddings().weight.detach().clone()
    assert add_tokens(model, base, [PAD, IM_START, IM_END]) == 3
    assert len(base) == 32003 and model.get_input_embeddings().num_embeddings == 32003
    assert model.get_output_embeddings().weight.shape[0] == 32003
    new_rows = model.get_input_embeddings().weight[32000:].detach()
    assert torch.allclose(new_rows.mean(0), old.mean(0), atol=0.05)  # mean-initialised rows
    assert torch.equal(model.get_input_embeddings().weight[:32000], old)

    small = create_model(get_preset("llama-0.5m", vocab_size=100))
    with pytest.raises(BadInput, match="the tokenizer has 32003 tokens but the model's embedding table has 100 rows"):
        check_vocab(small, base)
