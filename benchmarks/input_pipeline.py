"""Throughput of the training input pipeline alone (no model step): how fast one host's
training iterator hands out its batches.

  python benchmarks/input_pipeline.py --config=configs/multi30k.py --workdir=/tmp/bench_m30k
  python benchmarks/input_pipeline.py --config=configs/conll2003.py --hosts=4

The data is the config's (the tokenizer is trained once and kept in --workdir). After
--warmup untimed batches, --batches batches are timed. Reported: global batches per second
(for --hosts=P, those this host can feed its rows of, as host 0 of P), examples per second
(examples this host reads: the length limit's count) and tokens per second (the task's count of the
real tokens in this host's rows, times P), and the process's peak resident memory.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags
from ml_collections import config_flags

from transformer_jax import errors
from transformer_jax.training.experiment import Experiment

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, as for train.py.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where the tokenizer is trained once and kept.")
_HOSTS = flags.DEFINE_integer("hosts", 1, "Read as host 0 of this many.", lower_bound=1)
_WARMUP = flags.DEFINE_integer("warmup", 20, "Untimed batches first.", lower_bound=0)
_BATCHES = flags.DEFINE_integer("batches", 300, "Timed batches.", lower_bound=1)


def main(argv: list[str]) -> None:
  del argv
  config = _CONFIG.value
  experiment = Experiment.create(config, _WORKDIR.value)
  hosts = _HOSTS.value
  batches = experiment.data.train_iterator(experiment.task, config.batch_size,
                                           shard_index=0, shard_count=hosts)
  for _ in range(_WARMUP.value):
    next(batches)
  examples_before = batches.stats()["data/examples"]
  tokens = 0
  start = time.perf_counter()
  for _ in range(_BATCHES.value):
    tokens += experiment.task.count_tokens(next(batches)) * hosts
  seconds = time.perf_counter() - start
  examples = batches.stats()["data/examples"] - examples_before
  batches.close()
  print(json.dumps({
      "hosts": hosts, "global_batch": config.batch_size, "batches": _BATCHES.value,
      "seconds": round(seconds, 3),
      "global_batches_per_sec": round(_BATCHES.value / seconds, 2),
      "examples_per_sec": round(examples / seconds, 1),
      "tokens_per_sec": round(tokens / seconds),
      "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  errors.run(main)
