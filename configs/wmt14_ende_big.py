"""Transformer (big) on WMT14 English-German: d_model 1024, d_ff 4096, 16 heads, dropout 0.3,
300k steps (paper Table 3). See wmt14_ende_base.py for batching and data.

  python train.py --config=configs/wmt14_ende_big.py --workdir=workdirs/wmt14_big
"""

import ml_collections

from configs import wmt14_ende_base


def get_config() -> ml_collections.ConfigDict:
  return wmt14_ende_base.get_config(big=True)
