"""The embedded default job: a small Transformer learns to reverse digit strings.

Runs offline on a 2-core CPU in a few minutes: `python train.py`.
Every field can be overridden: `python train.py --config.num_train_steps=500`.
"""

import dataclasses

import ml_collections
from ml_collections import config_dict

from transformer_jax.config import TransformerConfig
from transformer_jax.options import LORA_TARGETS


def model_defaults() -> dict:
  """Every TransformerConfig field but the vocabulary sizes and the packer's bound on
  segments per row (those come from the data: data.max_segments), at
  its default, so that each one can be set from a config file or the command line (a None
  default as a typed placeholder: ml_collections refuses to override a plain None)."""
  return {field.name: (config_dict.placeholder(int) if field.default is None
                       else field.default)
          for field in dataclasses.fields(TransformerConfig)
          if field.name not in ("vocab_size", "target_vocab_size", "max_segments")}


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.task = "seq2seq"
  config.seed = 0
  config.num_train_steps = 2400
  config.log_every_steps = 100
  config.eval_every_steps = 1200
  config.checkpoint_every_steps = 600
  config.keep_checkpoints = 3          # The most recent ones (paper §6.1 averages the last 5).
  # > 1: at the end, average the newest N checkpoints (paper §6.1) into W/exports/ and make
  # them the final model: its evaluation and the test split's are the run's final metrics.
  config.average_checkpoints = 0
  config.keep_best_checkpoints = 0     # Also keep the N best by best_checkpoint_metric.
  config.best_checkpoint_metric = "eval/exact_match"
  config.best_checkpoint_mode = "max"  # "max" or "min" (for eval/loss).
  config.batch_size = 64
  config.grad_accum_steps = 1
  config.label_smoothing = 0.0        # Targets are deterministic; nothing to smooth.
  config.nonfinite = "stop"           # "stop" or "skip" a step whose loss/grad is NaN/Inf.
  # Fine-tune: start from this export or checkpoint directory (its architecture, tokenizers
  # and parameters; dropout, dtype, remat and attention_impl from this config). A workdir
  # that has checkpoints resumes from them instead.
  config.init_from = ""

  config.data = ml_collections.ConfigDict()
  config.data.source = "synthetic"
  config.data.synthetic_task = "reverse"   # reverse | sort | add
  config.data.min_length = 2
  config.data.max_length = 16

  # TransformerConfig fields (vocab sizes come from the data).
  config.model = ml_collections.ConfigDict(dict(
      model_defaults(), d_model=128, num_heads=4, d_ff=512, num_encoder_layers=2, num_decoder_layers=2,
      dropout_rate=0.0, attention_dropout_rate=0.0, activation_dropout_rate=0.0,
      max_len=64, share_embeddings=True, tie_output=True, norm_position="post",
      positional="sinusoidal", activation="relu", attention_impl="xla",
      dtype="float32", param_dtype="float32", scan_layers=False, remat_policy="none",
      fused_qkv=False))

  config.optimizer = ml_collections.ConfigDict(dict(
      name="adam", b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.0,
      schedule="warmup_cosine", learning_rate=3e-3, warmup_steps=200, clip_grad_norm=1.0,
      end_learning_rate=0.0,       # warmup_cosine: the rate it decays to
      decay_matrices_only=False,   # adamw: weight decay on matrices only (not biases, norms)
      pretrained_rate_scale=1.0,   # init_from another task's encoder: its modules' rate factor
      muon_learning_rate=0.02,     # muon: the hidden matrices' peak rate (Adam's for the rest)
      muon_momentum=0.9,           # muon: its (Nesterov) momentum (RESULTS: 0.9 beat 0.95)
      muon_ns_steps=5))            # muon: Newton-Schulz iterations per update
  # Annealing to 0 matters here: with the paper's rsqrt decay the same model plateaus
  # below 99% exact match in this budget.

  # Search options for evaluation and predict.
  config.decode = ml_collections.ConfigDict(dict(
      beam_size=4, alpha=0.6, max_extra_length=4,
      bio_constrained=True,    # tagging: most likely valid BIO sequence (False: argmax per word)
      # lm: continuations of max_new_tokens, at temperature (0: greedy), from the top_k
      # tokens (0: all) and the top_p nucleus (1: all); seed fixes the draws
      max_new_tokens=200, temperature=0.8, top_k=0, top_p=1.0, seed=0))
  # Periodic evaluation: the first `examples` of the eval split (0 = all), teacher-forced
  # loss and decoding alike, `batch_size` rows per batch; `num_samples` printed.
  config.eval = ml_collections.ConfigDict(dict(batch_size=250, examples=1000, num_samples=5))
  # Device mesh (sharding.py): -1 takes the remaining devices. Multi-host: set
  # distributed.initialize=True (cluster read from the environment on Cloud TPU/SLURM), or
  # give coordinator_address "host:port", num_processes and process_id. shard_optimizer_state:
  # the Adam moments split over the data axis as well, parameters replicated (ZeRO-1).
  # reduce_gradients_in: auto (XLA sums the replicas' gradients in the backward matmuls'
  # dtype) | bfloat16 | float32 (summed explicitly in that dtype; fsdp = tensor = 1).
  config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1,
                                                shard_optimizer_state=False,
                                                reduce_gradients_in="auto"))
  config.distributed = ml_collections.ConfigDict(dict(
      initialize=False, coordinator_address="", num_processes=0, process_id=-1))
  # Self-pretraining (encoder tasks; docs/pretraining.md): enabled, train.py first trains a
  # masked LM on the training text in W/pretrain, then fine-tunes from it in W.
  config.pretrain = ml_collections.ConfigDict(dict(
      enabled=False, num_train_steps=2000,
      objective="mlm",           # mlm | rtd (replaced-token detection, ELECTRA's)
      discriminator_weight=50.0,  # rtd: the discriminator loss's weight (ELECTRA's lambda)
      batch_size=0,              # 0: the run's batch_size
      learning_rate=0.0,         # 0: the run's optimizer.learning_rate
      warmup_steps=500, mask_rate=0.15,
      vocab_size=0,              # sentencepiece: 0 = data.vocab_size
      extra_text="",             # data.extra_text for the stage (IMDB: unsup.txt)
      dropout_rate=0.1, attention_dropout_rate=0.1,   # the stage's own (BERT's)
      max_length=0,              # tokens per packed row; 0 = data.max_length
      too_long=""))              # a longer training text: "" = data.too_long | split ...
  # LoRA (docs/pretrained_models.md): rank > 0 fine-tunes init_from's model through adapters
  # W + alpha/rank * A B of the targeted kernels, the model frozen (lora.py).
  config.lora = ml_collections.ConfigDict(dict(rank=0, alpha=16.0, dropout=0.0,
                                               targets=LORA_TARGETS))
  return config


def text_data(**fields) -> ml_collections.ConfigDict:
  """The `data` group of real-text tasks (local files or TFDS), every field present so
  that each can be overridden on the command line; `fields` set the task's values."""
  data = ml_collections.ConfigDict(dict(
      source="local",            # local | tfds
      dir="",                    # local: folder with {split}.{lang} / {split}.tsv / {split}.txt
      name="",                   # tfds: dataset name, e.g. wmt14_translate/de-en
      tfds_data_dir="",          # tfds: where prepared datasets are ("" = TFDS default)
      download=False,            # tfds: try to download and prepare a missing dataset
      source_language="", target_language="",   # seq2seq: file suffixes / TFDS features
      labels="",                 # class names by label index, or the tag set ("" = train's)
      train_split="train", eval_split="validation", test_split="",
      tokenizer="sentencepiece",  # sentencepiece | words (tagging needs words) | chars
      vocab_size=8000, shared_vocab=True, spm_model_type="unigram",
      tokenizer_max_examples=0,  # train the tokenizer on a sample of this size (0 = all)
      min_word_count=2,          # words: rarer words map to their shape (<unk:Xx>, ...)
      max_length=64,             # training: tokens per packed row and per example
      too_long="drop",           # drop | truncate | split training examples over max_length
      truncate="head",           # a truncated example keeps its head | tail | head_tail
      br_tags="keep",            # classification: "<br />" in the text: keep | space
      text_of="",                # mlm: the task whose files hold the text
      extra_text="",             # mlm: a file in dir (or a path from it), one text a line
      layout="stream",           # lm: "stream" (windows of the token stream) | "documents"
      pack=True,                 # several examples per row (False: one, padded)
      max_segments=0,            # classification: label slots per packed row
      eval_max_length=128,       # evaluation: longest bucket (longer examples truncated)
      eval_batch_tokens=0,       # evaluation: at most rows x length tokens a batch (0: rows)
      prefetch=2))               # batches prepared ahead in a background thread
  data.update(fields)
  return data
