"""The Multi30k model of configs/multi30k.py (d_model 256, 3+3 layers, 4 heads, d_ff 512,
8,000 shared vocabulary) on batches of 64 rows of 32 source + 32 target tokens (4,096
tokens), for benchmarks.

  python -m benchmarks.train_step --config=benchmarks/configs/multi30k_size.py

The benchmarks feed random tokens of these shapes; only the model, batch and optimizer
fields are read.
"""

import ml_collections

from configs import multi30k


def get_config() -> ml_collections.ConfigDict:
  config = multi30k.get_config()
  config.batch_size = 64
  config.data = ml_collections.ConfigDict(dict(vocab_size=config.data.vocab_size,
                                               max_length=32))
  config.model.max_len = 128
  # The paper's schedule (learning_rate <= 0: its own peak), without clipping.
  config.optimizer.update(dict(schedule="rsqrt", learning_rate=0.0, warmup_steps=4000,
                               clip_grad_norm=0.0))
  return config
