"""Transformer (base) on WMT14 English-German, the paper's setup (Vaswani et al., 2017, §5).

  python train.py --config=configs/wmt14_ende_base.py --workdir=workdirs/wmt14_base

Batches: about 25,000 source + 25,000 target tokens per step (§5.1), as 96 packed rows of 256
tokens. On hardware that cannot hold that at once, keep the product and raise
grad_accum_steps, e.g. --config.grad_accum_steps=4 (24 rows per micro-batch).
The data source (TFDS wmt14_translate/de-en, SentencePiece 37k shared vocabulary, packing)
is built by the data pipeline; this file fixes the model, optimizer and decoding.
"""

import ml_collections

from configs import default


def get_config(big: bool = False) -> ml_collections.ConfigDict:
  config = default.get_config()
  d_model, d_ff, heads, dropout = (1024, 4096, 16, 0.3) if big else (512, 2048, 8, 0.1)

  config.num_train_steps = 300_000 if big else 100_000
  config.log_every_steps = 100
  config.eval_every_steps = 5000
  config.checkpoint_every_steps = 1000
  config.keep_checkpoints = 20        # §6.1 averages the last 5 (base) or 20 (big).
  config.batch_size = 96              # packed rows of data.max_length tokens
  config.grad_accum_steps = 1
  config.label_smoothing = 0.1        # §5.4

  config.data = ml_collections.ConfigDict(dict(
      source="tfds", name="wmt14_translate/de-en", source_language="en",
      target_language="de", vocab_size=37000, max_length=256, pack=True,
      eval_split="validation", test_split="test", eval_examples=3000))

  config.model = ml_collections.ConfigDict(dict(
      d_model=d_model, num_heads=heads, d_ff=d_ff, num_encoder_layers=6,
      num_decoder_layers=6, dropout_rate=dropout, attention_dropout_rate=0.0,
      activation_dropout_rate=0.0, max_len=512, share_embeddings=True, tie_output=True,
      norm_position="post", positional="sinusoidal", activation="relu",
      attention_impl="xla", dtype="float32", param_dtype="float32", scan_layers=False,
      remat_policy="none", fused_qkv=False))

  warmup = 4000
  config.optimizer = ml_collections.ConfigDict(dict(
      name="adam", b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.0, schedule="rsqrt",
      # Peak of lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), reached at warmup.
      learning_rate=d_model ** -0.5 * warmup ** -0.5, warmup_steps=warmup,
      clip_grad_norm=0.0))

  # §6.1: beam 4, alpha 0.6, maximum output length = input length + 50.
  config.decode = ml_collections.ConfigDict(dict(
      beam_size=4, alpha=0.6, max_extra_length=50, eval_examples=3000, batch_size=64,
      num_samples=5))
  return config
