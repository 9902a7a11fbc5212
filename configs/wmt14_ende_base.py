"""Transformer (base) on WMT14 English-German, the paper's setup (Vaswani et al., 2017, §5).

  python train.py --config=configs/wmt14_ende_base.py --workdir=workdirs/wmt14_base

Batches: about 25,000 source + 25,000 target tokens per step (§5.1), as 96 packed rows of 256
tokens. On hardware that cannot hold that at once, keep the product and raise
grad_accum_steps, e.g. --config.grad_accum_steps=4 (24 rows per micro-batch).
Data: TFDS wmt14_translate/de-en read through tfds.data_source (ArrayRecord). Prepare it once
where there is internet (`tfds build wmt14_translate/de-en --file_format=array_record
--data_dir=DIR`) and pass --config.data.tfds_data_dir=DIR. A shared SentencePiece vocabulary
of 37,000 pieces is trained on a 2M-pair sample of the training text (paper §5.1: BPE,
~37,000 tokens); training rows pack pairs up to 256 tokens; newstest2013 (validation) is
evaluated during training and newstest2014 (test) at the end.
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

  config.data = default.text_data(
      source="tfds", name="wmt14_translate/de-en", source_language="en",
      target_language="de", vocab_size=37000, tokenizer_max_examples=2_000_000,
      max_length=256, eval_max_length=512, eval_split="validation", test_split="test",
      eval_examples=3000)

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
  # Device mesh (sharding.py): -1 takes the remaining devices. Multi-host: set
  # distributed.initialize=True (cluster read from the environment on Cloud TPU/SLURM), or
  # give coordinator_address "host:port", num_processes and process_id.
  config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
  config.distributed = ml_collections.ConfigDict(dict(
      initialize=False, coordinator_address="", num_processes=0, process_id=-1))
  return config
