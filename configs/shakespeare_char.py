"""A character-level language model of Shakespeare's plays (decoder-only Transformer).

  python train.py --config=configs/shakespeare_char.py --workdir=workdirs/shakespeare
  printf 'ROMEO.\\n' | python -m transformer_jax.predict --workdir=workdirs/shakespeare

Data: ../shared/data/shakespeare (train.txt.gz: 38 works, 4.6M characters; val.txt.gz:
Julius Caesar and Twelfth Night, 231k characters). Reads the training text as one stream of
characters in windows of data.max_length; eval/loss (nats per character), perplexity and
eval/bits_per_character are over the whole val file.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.task = "lm"
  # 30 minutes of the 2-core CPU of 2026-11-27, alone: AdamW's 7,000 steps of 16 x 128
  # characters, or Muon's 5,500 (its step is 1.29x AdamW's), which score lower. The Xeon of
  # 2026-11-29 ran them about 2.2x slower (benchmarks/RESULTS.md).
  config.num_train_steps = 5500
  config.log_every_steps = 100
  config.eval_every_steps = 1000
  config.checkpoint_every_steps = 1000
  config.keep_checkpoints = 2
  config.batch_size = 16
  config.label_smoothing = 0.0
  config.best_checkpoint_metric = "eval/loss"
  config.best_checkpoint_mode = "min"

  config.data = default.text_data(
      dir="../shared/data/shakespeare", eval_split="val", tokenizer="chars",
      layout="stream", max_length=128, eval_max_length=128)

  # Pre-LN, no biases, tied embeddings (nanoGPT's), with rotary positions, RMSNorm and a
  # SwiGLU feed-forward: on a 4-layer, 128-wide model at 1,000 steps, rotary positions gave
  # val loss 1.738 against 2.032 with learned ones, SwiGLU (equal parameters) 1.971, all
  # three 1.682; RMSNorm alone 2.038 and 2 key/value heads of 4 2.065 (benchmarks/RESULTS.md).
  config.model.update(dict(
      d_model=192, num_heads=6, d_ff=512, num_encoder_layers=0, num_decoder_layers=6,
      dropout_rate=0.0, attention_dropout_rate=0.0, max_len=128, norm_position="pre",
      positional="rotary", norm_type="rms", gated_ffn=True, activation="silu",
      use_bias=False, attention_impl="auto", layer_norm_epsilon=1e-5))

  # Muon for the layers' matrices (rate 0.02 to 0.002 on the same cosine, momentum 0.9,
  # weight decay 0.1: the modded-nanogpt speedrun's split); for the rest nanoGPT's Shakespeare
  # optimizer's settings, as Nesterov Adam without decay (optax's Muon): beta2 0.99, 100
  # warm-up steps, cosine from 1e-3 to 1e-4; clipping at 1.0. name="adamw" is nanoGPT's own
  # (weight decay 0.1 on matrices), 7,000 steps in the same time.
  config.optimizer.update(dict(
      name="muon", b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1, decay_matrices_only=True,
      schedule="warmup_cosine", learning_rate=1e-3, end_learning_rate=1e-4,
      warmup_steps=100, clip_grad_norm=1.0, muon_learning_rate=0.02, muon_momentum=0.9))
  config.decode.update(dict(max_new_tokens=64, temperature=0.8, top_k=0, top_p=1.0))
  config.eval.update(dict(batch_size=128, examples=0, num_samples=2))
  return config
