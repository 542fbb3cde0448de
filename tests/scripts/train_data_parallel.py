"""Train a tiny model for 3 steps; run under torchrun / accelerate launch to use several processes.

usage: train_data_parallel.py OUT_DIR GRAD_ACCUM
"""
import sys

from slm_bench.lm.models import create_model, get_preset
from slm_bench.lm.packing import pack, text_example
from slm_bench.lm.tokenizer import train_tokenizer
from slm_bench.train.engine import CausalLM, PackedRows, TrainConfig, Trainer

out, accum = sys.argv[1], int(sys.argv[2])
corpus = [f"Tom has {a} apples and buys {b} more, so he has {a + b} apples." for a in range(2, 30) for b in range(2, 12)]
tokenizer = train_tokenizer(corpus, vocab_size=320)
model = create_model(get_preset("llama-0.5m", vocab_size=len(tokenizer), max_position_embeddings=64), seed=0)
rows = pack([text_example(tokenizer, t) for t in corpus], seq_len=32, pad_id=tokenizer.pad_token_id)
config = TrainConfig(steps=3, micro_batch_size=4, grad_accum=accum, progress=False)
trainer = Trainer(model, CausalLM(), PackedRows(rows, 4, 0), config, out, tokenizer)
trainer.train(resume=False)
print(f"rank {trainer.accelerator.process_index} of {trainer.accelerator.num_processes} done", flush=True)
