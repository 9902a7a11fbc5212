"""The pretraining stage of configs/sst2.py on its own: a masked language model on the text
of SST-2's training phrases (no labels), with sst2's encoder, vocabulary settings and data.

  python train.py --config=configs/sst2_pretrain.py --workdir=workdirs/sst2_pretrain
  python train.py --config=configs/sst2.py \\
      --config.init_from=workdirs/sst2_pretrain/checkpoints/3000 --workdir=workdirs/sst2_ft

`python train.py --config=configs/sst2.py --config.pretrain.enabled=True` runs both stages in
one command (docs/pretraining.md); sst2 trains from scratch by default, its best recipe.
The pretraining options are sst2's `pretrain` group; this file derives the stage's config
from it (training/recipe.py `pretraining_config`).
"""

import ml_collections

from configs import sst2
from transformer_jax.training.recipe import pretraining_config


def get_config() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(pretraining_config(sst2.get_config().to_dict()))
