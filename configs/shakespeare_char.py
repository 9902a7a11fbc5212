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
  config.num_train_steps = 2000
  config.log_every_steps = 100
  config.eval_every_steps = 500
  config.checkpoint_every_steps = 500
  config.keep_checkpoints = 2
  config.batch_size = 12
  config.label_smoothing = 0.0
  config.best_checkpoint_metric = "eval/loss"
  config.best_checkpoint_mode = "min"

  config.data = default.text_data(
      dir="../shared/data/shakespeare", eval_split="val", tokenizer="chars",
      layout="stream", max_length=64, eval_max_length=64)

  # nanoGPT's CPU shape for Shakespeare (4 layers, 4 heads, 128 wide, block 64) in its
  # architecture: pre-LN, learned positions, GELU, no biases, tied embeddings.
  config.model.update(dict(
      d_model=128, num_heads=4, d_ff=512, num_encoder_layers=0, num_decoder_layers=4,
      dropout_rate=0.0, attention_dropout_rate=0.0, max_len=64, norm_position="pre",
      positional="learned", activation="gelu", use_bias=False, attention_impl="auto",
      layer_norm_epsilon=1e-5))

  config.optimizer.update(dict(
      name="adamw", b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1, decay_matrices_only=True,
      schedule="warmup_cosine", learning_rate=1e-3, end_learning_rate=1e-4,
      warmup_steps=100, clip_grad_norm=1.0))
  config.decode.update(dict(max_new_tokens=32, temperature=0.8, top_k=0, top_p=1.0))
  config.eval.update(dict(batch_size=256, examples=0, num_samples=2))
  return config
