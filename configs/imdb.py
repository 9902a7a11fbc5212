"""IMDB movie-review sentiment (the task of the IMDB tutorials): an encoder-only classifier
trained on a CPU without outside data (a masked LM on the task's own reviews first), on the
Large Movie Review Dataset's local files.

  python train.py --config=configs/imdb.py --workdir=workdirs/imdb

Data (the default): ../shared/data/imdb: train.tsv.gz (22,500 reviews) and dev.tsv.gz
(2,500, taken from the official train split), header `sentence<TAB>label`, 0 = negative,
1 = positive; unsup.txt.gz: the 50,000 unlabelled reviews, one a line, which only the
pretraining stage reads (pretrain.extra_text). Reports eval/accuracy on dev. The official
test split is kept out. `<br />` tags become spaces (data.br_tags).

Reviews are long (benchmarks/RESULTS.md, "IMDB"): rows hold data.max_length = 512 tokens
(84% of reviews whole; at 256, 46% were cut and seed 0 reached 87.96% dev against 89.28%
here), and a longer review keeps its first quarter and its last three quarters
(data.truncate="head_tail": openings and verdicts carry the sentiment); evaluation batches hold at most
data.eval_batch_tokens tokens, so a bucket of long reviews is split into fewer rows.
`predict` and the server cut a longer review the same way (and read `<br />` as spaces);
--too_long=refuse refuses it instead, naming its line.

From TFDS instead (prepared where there is internet: `tfds build imdb_reviews
--file_format=array_record --data_dir=DIR`): --config.data.source=tfds
--config.data.name=imdb_reviews --config.data.eval_split=test
--config.data.tfds_data_dir=DIR (TFDS has no dev split; its test split is the official one).
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.task = "classification"
  config.num_train_steps = 2000        # dev accuracy is near its best from step 1,000
  config.log_every_steps = 100
  config.eval_every_steps = 1000
  config.checkpoint_every_steps = 500
  config.keep_checkpoints = 3
  # The final model is step 2,000's own: on seeds 0-2 (dev) it gave 89.80% against 89.73%
  # for the mean of the last two checkpoints and 89.45% for the last three (step 1,000's
  # model is still a point behind; benchmarks/RESULTS.md, "IMDB").
  config.average_checkpoints = 0
  config.batch_size = 16              # packed rows of data.max_length tokens (8,192 a step)
  config.best_checkpoint_metric = "eval/accuracy"
  config.label_smoothing = 0.0

  config.data = default.text_data(
      dir="../shared/data/imdb", labels="negative,positive", eval_split="dev",
      vocab_size=8000, tokenizer_max_examples=25000, br_tags="space", max_length=512,
      too_long="truncate", truncate="head_tail", max_segments=4, eval_max_length=512,
      eval_batch_tokens=16384)

  config.model.update(dict(
      d_model=128, num_heads=4, d_ff=512, num_encoder_layers=2, num_decoder_layers=0,
      dropout_rate=0.2, attention_dropout_rate=0.1, max_len=512))
  config.model.pooling = "mean"       # mean | max | first (the classifier's head)

  config.optimizer.update(dict(name="adamw", weight_decay=0.01, schedule="warmup_cosine",
                               learning_rate=1e-3, warmup_steps=300, clip_grad_norm=1.0))
  config.eval.update(dict(batch_size=64, examples=0, num_samples=3))

  # Self-pretraining (docs/pretraining.md): a masked LM on the training reviews and the
  # 50,000 unlabelled ones in W/pretrain, with the vocabulary trained there on a sample of
  # 25,000 of them, then the classifier from its encoder in W. On by default: the best
  # recipe measured, in one command. From scratch: --config.pretrain.enabled=False (then the
  # vocabulary is trained on train.tsv alone). The stage (benchmarks/RESULTS.md, "The masked
  # LM's plateau"): rows of 128 tokens, 64 a step, no dropout, each long review split into
  # 128-token pieces; 32 min alone. At the classifier's rows of 512 with dropout it sat at
  # 12% masked accuracy; cut to its head and tail it gave no gain (seed 0: 89.32% dev against
  # 89.28% from scratch); in pieces, 89.80 +- 0.35% dev over seeds 0-2 (2026-11-26), from scratch
  # 89.35 +- 0.32% on the same code. Replaced-token detection as the stage
  # (--config.pretrain.objective=rtd), seeds 0-2: 89.25 +- 0.34% (2026-11-27).
  config.pretrain.update(dict(enabled=True, num_train_steps=3400, warmup_steps=500,
                              batch_size=64, max_length=128, too_long="split",
                              dropout_rate=0.0, attention_dropout_rate=0.0,
                              extra_text="unsup.txt"))
  return config
