"""GPT-2 small's shapes (Radford et al., 2019: 12 layers, 12 heads, 768 wide, a context of
1,024 tokens, a vocabulary of 50,257) as a decoder-only language model, trained with
nanoGPT's GPT-2 recipe (AdamW, b2 0.95, weight decay 0.1 on matrices, cosine from 6e-4 to
6e-5 over 600,000 steps, clipping at 1.0, about 0.5M tokens a step).

  python -m transformer_jax.aot --config=configs/gpt2_small.py --topology=v5p:2x2x1
  python -m transformer_jax.aot --config=configs/gpt2_small.py --target=h100-sxm:1
  python -m benchmarks.train_step --config=configs/gpt2_small.py --batch_size=16
  python train.py --config=configs/gpt2_small.py --workdir=workdirs/gpt2_small

The planners and benchmarks read the vocabulary from data.vocab_size: 50,257, GPT-2's BPE.
A run trains its own SentencePiece BPE on the text instead (GPT-2's tokenizer is not
read), which a corpus as small as ../shared/data/shakespeare caps well below that size.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.task = "lm"
  config.num_train_steps = 600_000
  config.log_every_steps = 100
  config.eval_every_steps = 2000
  config.checkpoint_every_steps = 2000
  config.best_checkpoint_metric = "eval/loss"
  config.best_checkpoint_mode = "min"
  # 512 rows of 1,024 tokens (524,288 tokens a step) in 16 micro-batches of 32 rows: 64 rows
  # need 67 GiB on one H100, which has 59 for JAX (aot's plan). On v5p-8, 8 micro-batches
  # of 64 fit (12 GiB a chip), for 464 ms a step against 529 (XLA's cost model, einsum).
  config.batch_size = 512
  config.grad_accum_steps = 16

  config.data = default.text_data(
      dir="../shared/data/shakespeare", eval_split="val", tokenizer="sentencepiece",
      spm_model_type="bpe", vocab_size=50257, layout="stream", max_length=1024,
      eval_max_length=1024)

  # GPT-2: pre-LN with a final LayerNorm, learned positions, GELU (tanh), biases, output
  # tied to the token embedding, embeddings not scaled by sqrt(d_model), GPT-2's
  # initialisation (the one that reproduces nanoGPT's loss at its CPU recipe). No dropout, as
  # nanoGPT pretrains (GPT-2 had 0.1), which also lets the fused attention kernels run
  # (they have no attention dropout).
  config.model.update(dict(
      d_model=768, num_heads=12, d_ff=3072, num_encoder_layers=0, num_decoder_layers=12,
      max_len=1024, norm_position="pre", positional="learned", activation="gelu",
      use_bias=True, tie_output=True, scale_embeddings=False, weight_init="gpt2",
      layer_norm_epsilon=1e-5,
      dropout_rate=0.0, attention_dropout_rate=0.0, activation_dropout_rate=0.0,
      dtype="bfloat16", attention_impl="auto"))
  # The output layer and its loss over this many slices of the positions, so that the
  # (rows x 1,024 x 50,257) float32 logits are never held whole (1: one pass).
  config.model.loss_tiles = 1

  config.optimizer.update(dict(
      name="adamw", b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, decay_matrices_only=True,
      schedule="warmup_cosine", learning_rate=6e-4, end_learning_rate=6e-5,
      warmup_steps=2000, clip_grad_norm=1.0))
  config.decode.update(dict(max_new_tokens=200, temperature=0.8, top_k=200, top_p=1.0))
  config.eval.update(dict(batch_size=64, examples=0, num_samples=2))
  return config
