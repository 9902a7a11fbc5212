"""IMDB movie-review sentiment (the task of the IMDB tutorials): an encoder-only classifier
on TFDS imdb_reviews (25,000 training and 25,000 test reviews, labels neg/pos).

  python train.py --config=configs/imdb.py --workdir=workdirs/imdb \\
      --config.data.tfds_data_dir=DIR

The dataset must be prepared first where there is internet:
`tfds build imdb_reviews --file_format=array_record --data_dir=DIR`. Reviews average about
300 SentencePiece tokens, so rows hold up to 512 tokens (longer reviews are truncated and
counted) and this is a job for an accelerator; on this project's CPU it runs on TFDS mock
data in the tests only. Reports eval/accuracy on the test split (IMDB has no validation
split).
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.task = "classification"
  config.num_train_steps = 10_000
  config.log_every_steps = 100
  config.eval_every_steps = 2000
  config.checkpoint_every_steps = 1000
  config.keep_checkpoints = 2
  config.batch_size = 32              # packed rows of data.max_length tokens
  config.best_checkpoint_metric = "eval/accuracy"
  config.label_smoothing = 0.0

  config.data = default.text_data(
      source="tfds", name="imdb_reviews", eval_split="test", vocab_size=16000,
      tokenizer_max_examples=25000, max_length=512, too_long="truncate", max_segments=8,
      eval_max_length=512)

  config.model.update(dict(
      d_model=256, num_heads=4, d_ff=1024, num_encoder_layers=4, num_decoder_layers=0,
      dropout_rate=0.1, attention_dropout_rate=0.1, max_len=512))
  config.model.pooling = "mean"       # mean | max | first (the classifier's head)

  config.optimizer.update(dict(name="adamw", weight_decay=0.01, schedule="warmup_cosine",
                               learning_rate=5e-4, warmup_steps=1000, clip_grad_norm=1.0))
  config.eval.update(dict(batch_size=64, examples=0, num_samples=3))
  return config
