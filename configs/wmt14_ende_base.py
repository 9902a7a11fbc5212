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
from transformer_jax.config import TransformerConfig


def get_config(big: bool = False) -> ml_collections.ConfigDict:
  config = default.get_config()
  preset = TransformerConfig.big if big else TransformerConfig.base   # paper Table 3

  config.num_train_steps = 300_000 if big else 100_000
  config.log_every_steps = 100
  config.eval_every_steps = 5000
  config.checkpoint_every_steps = 1000
  config.keep_checkpoints = 20        # §6.1 averages the last 5 (base) or 20 (big).
  config.batch_size = 96              # packed rows of data.max_length tokens
  config.grad_accum_steps = 1
  config.label_smoothing = 0.1        # §5.4
  config.best_checkpoint_metric = "eval/bleu"

  config.data = default.text_data(
      source="tfds", name="wmt14_translate/de-en", source_language="en",
      target_language="de", vocab_size=37000, tokenizer_max_examples=2_000_000,
      max_length=256, eval_max_length=512, eval_split="validation", test_split="test")

  # Every TransformerConfig field of the preset; the vocabulary sizes come from the data.
  model = preset(vocab_size=config.data.vocab_size).to_dict()
  del model["vocab_size"], model["target_vocab_size"], model["max_segments"]   # the data's
  config.model = ml_collections.ConfigDict(model)
  # The explicit attention path keeps Q.K^T in the compute dtype (bf16 on TPU; the softmax
  # is still float32), where jax.nn.dot_product_attention stores it in float32: XLA's TPU
  # cost model puts the big model's bf16 step on v5p-8 at 42.1 -> 41.2 ms and 7.6 -> 5.9
  # GiB per chip (benchmarks/RESULTS.md). In float32 the two agree up to rounding.
  # On an NVIDIA GPU, cuDNN's attention fed a dense mask was already 12% faster than einsum
  # on an H200 at 96 rows (benchmarks/RESULTS.md); --config.model.attention_impl=auto runs
  # the fused kernels with native masks (cuDNN on GPUs, splash on TPUs; docs/gpu.md), the
  # default once a GPU has measured them.
  config.model.attention_impl = "einsum"
  # Self-attention's query, key and value from one (d_model, 3, heads, d_k) kernel: the same
  # model (params.split_qkv converts), one larger matmul for the MXU; XLA's estimate for a
  # 1+1-layer big step on v5p-8: 10.16 -> 9.90 ms (benchmarks/RESULTS.md).
  config.model.fused_qkv = True
  # The output layer and its loss over slices of the target positions, so that the
  # (tokens, 37,000) logits are never held whole: --config.model.loss_tiles=8 (1: one pass).
  config.model.loss_tiles = 1

  # Every chip on fsdp (ZeRO-3): parameters and Adam state split, weights gathered layer by
  # layer. XLA's TPU cost model, big at 96 rows in bf16: v5p-8 38.0 ms a step against 41.0
  # with pure data parallelism (4.5 against 5.9 GiB a chip), v5p-64 8.0 against 12.0 ms;
  # base on v5p-8 16.4 against 17.5 ms (benchmarks/RESULTS.md). Across slices or hosts
  # without a fast interconnect, put those on data: --config.mesh.data=N.
  config.mesh.update(dict(data=1, fsdp=-1))

  warmup = 4000
  config.optimizer = ml_collections.ConfigDict(dict(
      name="adam", b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.0, schedule="rsqrt",
      # Peak of lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), reached at warmup.
      learning_rate=model["d_model"] ** -0.5 * warmup ** -0.5, warmup_steps=warmup,
      clip_grad_norm=0.0))

  # §6.1: beam 4, alpha 0.6, maximum output length = input length + 50.
  config.decode.update(dict(beam_size=4, alpha=0.6, max_extra_length=50))
  config.eval.update(dict(batch_size=64, examples=3000, num_samples=5))
  return config
