"""nanoGPT's CPU recipe for Shakespeare characters on our trainer: the side-by-side
comparison with karpathy/nanoGPT's train.py (benchmarks/RESULTS.md, "Language models").

  python train.py --config=benchmarks/configs/shakespeare_char_nanogpt.py --workdir=W

nanoGPT's README command for a CPU (4 layers, 4 heads, 128 wide, block 64, batch 12, 2,000
iterations, no dropout) and its config/train_shakespeare_char.py optimizer (AdamW β2 0.99,
weight decay 0.1 on matrices, 100 warm-up steps, cosine from 1e-3 to 1e-4, clipping at 1.0)
in its architecture: pre-LN, learned positions, GELU, no biases, tied embeddings, and its
initialisation (`weight_init="gpt2"`, embeddings not scaled by sqrt(d_model)): with ours
(Xavier-uniform) the val loss is 0.026 lower than nanoGPT's, with its own 0.017 higher
(benchmarks/RESULTS.md).
"""

import ml_collections

from configs import shakespeare_char


def get_config() -> ml_collections.ConfigDict:
  config = shakespeare_char.get_config()
  config.num_train_steps = 2000
  config.eval_every_steps = 2000
  config.checkpoint_every_steps = 1000
  config.batch_size = 12
  config.data.max_length = config.data.eval_max_length = 64
  config.model.update(dict(
      d_model=128, num_heads=4, d_ff=512, num_decoder_layers=4, max_len=64,
      positional="learned", norm_type="layer", gated_ffn=False, activation="gelu",
      weight_init="gpt2", scale_embeddings=False))
  config.optimizer.update(dict(name="adamw", learning_rate=1e-3, end_learning_rate=1e-4,
                               warmup_steps=100))
  return config
