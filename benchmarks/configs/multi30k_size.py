"""A Multi30k-size Transformer for benchmarks: d_model 256, 3+3 layers, 4 heads, d_ff 1024,
8,000 shared vocabulary, batches of 64 rows of 32 source + 32 target tokens (4,096 tokens).

  python -m benchmarks.train_step --config=benchmarks/configs/multi30k_size.py

The benchmarks feed random tokens of these shapes; only the model, batch and optimizer
fields are read.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.batch_size = 64
  config.label_smoothing = 0.1
  config.data = ml_collections.ConfigDict(dict(vocab_size=8000, max_length=32))
  config.model.update(dict(d_model=256, num_heads=4, d_ff=1024, num_encoder_layers=3,
                           num_decoder_layers=3, dropout_rate=0.1, max_len=128))
  config.optimizer.update(dict(schedule="rsqrt", learning_rate=0.0, warmup_steps=4000,
                               clip_grad_norm=0.0))
  return config
