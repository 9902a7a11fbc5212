"""What the benchmarks share: the config file and its overrides, synthetic batches, timing,
the accelerator's peak rate, and printing a result as a table or one JSON object.

Flags common to `benchmarks.train_step` and `benchmarks.decode` are defined here:
  --config=FILE (ml_collections, as for train.py; any field overridable as --config.a.b=V):
    a translation (task seq2seq) or language model (task lm) config
  --batch_size --src_length --tgt_length (seq2seq) or --length (lm) --vocab_size: the batch
    (default: from the config)
  --dtype --attention --scan --remat --fused_qkv: TransformerConfig overrides
  --warmup --steps: untimed then timed calls; --json; --seed
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from ml_collections import config_flags

from transformer_jax.accelerators import KNOWN_PEAKS, compiled_memory  # noqa: F401 (re-exported)
from transformer_jax.config import BOS_ID, KERNELS, PAD_ID, UNK_ID, TransformerConfig
from transformer_jax.errors import UserError
from transformer_jax.modules.models import REMAT_POLICIES
from transformer_jax.platforms import cudnn_version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(ROOT, "configs", "default.py"),
    "Config file (ml_collections), as for train.py; fields overridable as --config.a.b=V.",
    lock_config=True)
flags.DEFINE_integer("batch_size", None, "Rows per batch (default: config.batch_size).")
flags.DEFINE_integer("src_length", None, "Source length (default: config.data.max_length).")
flags.DEFINE_integer("tgt_length", None, "Target length (default: config.data.max_length).")
flags.DEFINE_integer("length", None, "A language model's (task lm) tokens per row (default: "
                     "config.data.max_length).")
flags.DEFINE_integer("vocab_size", None, "Vocabulary (default: config.data.vocab_size of a "
                     "SentencePiece config, or the synthetic task's).")
flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Compute dtype (parameters stay "
                  "float32).")
flags.DEFINE_enum("attention", None, ["einsum", "xla", *KERNELS, "auto"],
                  "Attention implementation (model.attention_impl).")
flags.DEFINE_bool("scan", None, "nn.scan over layers (model.scan_layers).")
flags.DEFINE_enum("remat", None, ["none", *REMAT_POLICIES], "Remat policy.")
flags.DEFINE_bool("fused_qkv", None, "Fused query/key/value projection.")
flags.DEFINE_integer("warmup", 2, "Untimed calls after compilation.", lower_bound=0)
flags.DEFINE_integer("steps", 10, "Timed calls (each ended with block_until_ready).",
                     lower_bound=1)
flags.DEFINE_integer("block", 5, "Consecutive timed calls of one contender before the next "
                     "one's turn (see common.time_interleaved).", lower_bound=1)
flags.DEFINE_bool("json", False, "Print one JSON object instead of a table.")
flags.DEFINE_integer("seed", 0, "Seed of the parameters and the random batch.")
FLAGS = flags.FLAGS

_MODEL_FLAGS = {"dtype": "dtype", "attention": "attention_impl", "scan": "scan_layers",
                "remat": "remat_policy", "fused_qkv": "fused_qkv"}


TASKS = ("seq2seq", "lm")
PACKED_SEGMENTS = 16


@dataclasses.dataclass(frozen=True)
class Setup:
  """The resolved benchmark problem. A language model (task "lm") has no source: its rows
  are `tgt_length` tokens and `src_length` is 0."""
  config: Any                  # the ml_collections config (optimizer, label smoothing, ...)
  model: TransformerConfig
  head: dict[str, Any]         # the task's options of the model group
  batch_size: int
  src_length: int
  tgt_length: int
  task: str = "seq2seq"        # one of TASKS


def setup() -> Setup:
  """The config file with its overrides, then the benchmark flags on top."""
  config = _CONFIG.value
  task = config.get("task", "seq2seq")
  if task not in TASKS:
    raise UserError(f"task={task!r}: the benchmarks time translation (seq2seq) and language "
                    "model (lm) configs")
  values = dict(config.model.to_dict())
  for flag, field in _MODEL_FLAGS.items():
    if FLAGS[flag].value is not None:
      values[field] = FLAGS[flag].value
  data = config.get("data", {})
  tokenizer = data.get("tokenizer", "sentencepiece")
  if data.get("source") != "synthetic" and tokenizer != "sentencepiece" and not FLAGS.vocab_size:
    raise UserError(f"data.tokenizer={tokenizer!r}: its vocabulary size is known only after "
                    "reading the data; pass --vocab_size")
  vocab_size = FLAGS.vocab_size or data.get("vocab_size")
  src_length = tgt_length = data.get("max_length")
  if data.get("source") == "synthetic":         # sizes come from the synthetic task
    from transformer_jax.data.synthetic import SyntheticData
    synthetic = SyntheticData(data.synthetic_task, data.min_length, data.max_length,
                              config.seed)
    vocab_size = vocab_size or synthetic.vocab.vocab_size
    src_length, tgt_length = synthetic.src_length, synthetic.tgt_length
  if task == "lm":      # one sequence a row: --length, not the seq2seq sides
    for flag in ("src_length", "tgt_length"):
      if FLAGS[flag].value is not None:
        raise UserError(f"--{flag} is for seq2seq configs; a language model's rows are "
                        "--length tokens")
    src_length, tgt_length = 0, FLAGS.length or tgt_length
    lengths = {"length": tgt_length}
  else:
    if FLAGS.length is not None:
      raise UserError("--length is for lm configs; give a seq2seq config's --src_length "
                      "and --tgt_length")
    src_length = FLAGS.src_length or src_length
    tgt_length = FLAGS.tgt_length or tgt_length
    lengths = {"src_length": src_length, "tgt_length": tgt_length}
  for name, value in {"vocab_size": vocab_size, **lengths}.items():
    if not value:
      raise UserError(f"the config gives no {name}; pass --{name}")
  values["vocab_size"] = vocab_size
  # Packed rows (--packed) hold at most this many sequences (random_batch keeps the bound,
  # 0: none): what cuDNN's packed layout is sized by.
  values["max_segments"] = data.get("max_segments") or PACKED_SEGMENTS
  from transformer_jax.tasks import split_model_fields, task_class
  fields, head = split_model_fields(task_class(task), values)
  model = TransformerConfig.from_dict(fields)
  longest = max(src_length, tgt_length)
  if longest > model.max_len:
    raise UserError(f"sequence length {longest} exceeds model.max_len={model.max_len}; "
                    "pass --config.model.max_len")
  return Setup(config, model, head, FLAGS.batch_size or config.batch_size, src_length,
               tgt_length, task)


# ---------------------------------------------------------------------------------- data
def random_batch(s: Setup, seed: int, packed: bool = False) -> dict[str, np.ndarray]:
  """A training batch of random real tokens (ids above the special ones). Full rows by
  default; `packed` fills each row with several examples of random lengths (segment ids
  1, 2, ..., positions restarting at 0, PAD after the last one that fits), as the data
  pipeline's packing does. The task's batch keys: src, tgt_in, tgt_out (and segment ids
  and positions of each side when packed), or a language model's inputs, targets,
  positions and segment_ids."""
  if s.task == "lm":
    return _lm_batch(s, seed, packed)
  rng = np.random.default_rng(seed)
  low = UNK_ID + 1
  vocab = s.model.vocab_size
  shape_src, shape_tgt = (s.batch_size, s.src_length), (s.batch_size, s.tgt_length)
  batch = {"src": rng.integers(low, vocab, shape_src, dtype=np.int32),
           "tgt_out": rng.integers(low, s.model.tgt_vocab_size, shape_tgt, dtype=np.int32)}
  if packed:
    segments = {k: np.zeros(shape, np.int32) for k, shape in (("src", shape_src),
                                                             ("tgt", shape_tgt))}
    for row in range(s.batch_size):
      ends, segment = {"src": 0, "tgt": 0}, 1
      while True:
        lengths = {"src": int(rng.integers(max(1, s.src_length // 8), s.src_length // 2 + 2)),
                   "tgt": int(rng.integers(max(1, s.tgt_length // 8), s.tgt_length // 2 + 2))}
        if (0 < s.model.max_segments < segment
            or any(ends[k] + lengths[k] > segments[k].shape[1] for k in ends)):
          break
        for k in ends:
          segments[k][row, ends[k]:ends[k] + lengths[k]] = segment
          ends[k] += lengths[k]
        segment += 1
    batch["src"][segments["src"] == 0] = PAD_ID
    batch["tgt_out"][segments["tgt"] == 0] = PAD_ID
    batch["src_segment_ids"], batch["tgt_segment_ids"] = segments["src"], segments["tgt"]
    batch["src_positions"] = _positions(segments["src"])
    batch["tgt_positions"] = _positions(segments["tgt"])
  # Decoder input: each example's target shifted right behind BOS.
  tgt_in = np.concatenate([np.full((s.batch_size, 1), BOS_ID, np.int32),
                           batch["tgt_out"][:, :-1]], axis=1)
  if packed:
    starts = batch["tgt_positions"] == 0
    tgt_in[starts] = BOS_ID
    tgt_in[batch["tgt_segment_ids"] == 0] = PAD_ID
  batch["tgt_in"] = tgt_in
  return batch


def _lm_batch(s: Setup, seed: int, packed: bool) -> dict[str, np.ndarray]:
  """Rows of tgt_length tokens: each document's inputs are BOS + its targets but the last."""
  rng = np.random.default_rng(seed)
  shape = (s.batch_size, s.tgt_length)
  targets = rng.integers(UNK_ID + 1, s.model.vocab_size, shape, dtype=np.int32)
  segments = np.ones(shape, np.int32)
  if packed:
    segments[:] = 0
    for row in range(s.batch_size):
      start, segment = 0, 1
      while True:
        length = int(rng.integers(max(1, s.tgt_length // 8), s.tgt_length // 2 + 2))
        if 0 < s.model.max_segments < segment or start + length > s.tgt_length:
          break
        segments[row, start:start + length] = segment
        start, segment = start + length, segment + 1
  positions = (_positions(segments) if packed else
               np.broadcast_to(np.arange(s.tgt_length, dtype=np.int32), shape).copy())
  inputs = np.concatenate([np.full((s.batch_size, 1), BOS_ID, np.int32), targets[:, :-1]], 1)
  inputs[positions == 0] = BOS_ID
  for array in (inputs, targets):
    array[segments == 0] = PAD_ID
  return {"inputs": inputs, "targets": targets, "positions": positions, "segment_ids": segments}


def _positions(segments: np.ndarray) -> np.ndarray:
  """Position of each token within its segment (0 for padding)."""
  positions = np.zeros_like(segments)
  for row in range(segments.shape[0]):
    for t in range(1, segments.shape[1]):
      same = segments[row, t] == segments[row, t - 1]
      positions[row, t] = positions[row, t - 1] + 1 if same else 0
  return np.where(segments > 0, positions, 0)


def count_tokens(batch: dict[str, np.ndarray]) -> int:
  """Non-padding tokens as the training loop counts them: source + target, or a language
  model's targets."""
  keys = ("targets",) if "targets" in batch else ("src", "tgt_out")
  return int(sum((batch[k] != PAD_ID).sum() for k in keys))


# -------------------------------------------------------------------------------- timing
def time_interleaved(calls: dict[str, Callable[[], Any]], warmup: int, steps: int,
                     block: int = 1) -> dict[str, list[float]]:
  """Seconds per call of each of `calls`, timed in turns after `warmup` untimed rounds, so
  that on a shared machine every contender sees the same load: `block` consecutive calls of
  one, then of the next (a a b b c c a a ...), until each has `steps`. Each call must block
  until its results are ready (block_until_ready / synchronize).

  Blocks longer than 1 matter when runtimes share the cores: PyTorch's OpenMP workers keep
  spinning for a while after each step and slow whatever runs next, so one-step turns would
  charge that to the other contender; in blocks only each block's first call pays it, which
  the median ignores."""
  if block < 1 or steps < 1:
    raise ValueError(f"block={block} and steps={steps} must both be >= 1")
  for _ in range(warmup):
    for call in calls.values():
      call()
  times: dict[str, list[float]] = {name: [] for name in calls}
  while any(len(t) < steps for t in times.values()):
    for name, call in calls.items():
      for _ in range(min(block, steps - len(times[name]))):
        start = time.perf_counter()
        call()
        times[name].append(time.perf_counter() - start)
  return times


def stats_ms(times: list[float]) -> dict[str, float]:
  ms = [1000.0 * t for t in times]
  return {"median": statistics.median(ms), "mean": statistics.fmean(ms), "min": min(ms),
          "max": max(ms), "stdev": statistics.stdev(ms) if len(ms) > 1 else 0.0,
          "n": len(ms)}


def compile_jitted(fn: Callable, *args: Any) -> tuple[Any, dict[str, float]]:
  """AOT-compiles a jitted function for `args`: (executable, {"lower_s", "compile_s", ...})
  where compile_s covers tracing, lowering and XLA compilation together (wall clock), and
  compile_cpu_s is the CPU time this process spent on it (all threads), which other
  processes on a shared machine disturb much less."""
  start, cpu_start = time.perf_counter(), time.process_time()
  lowered = fn.lower(*args)
  lowered_at = time.perf_counter()
  compiled = lowered.compile()
  done = time.perf_counter()
  return compiled, {"lower_s": lowered_at - start, "compile_s": done - start,
                    "xla_compile_s": done - lowered_at,
                    "compile_cpu_s": time.process_time() - cpu_start}


def peak_memory_bytes() -> int | None:
  """The device's peak allocated bytes where the backend reports it (GPU/TPU; not CPU)."""
  stats = jax.devices()[0].memory_stats()
  return None if not stats else stats.get("peak_bytes_in_use")


# ------------------------------------------------------------------------ device and peak
def device_info() -> dict[str, Any]:
  d = jax.devices()[0]
  cudnn = {"cudnn": cudnn_version()} if d.platform == "gpu" else {}
  return {"platform": d.platform, "kind": d.device_kind, "count": jax.device_count(),
          "host_cpus": os.cpu_count(), "jax": jax.__version__, **cudnn}


def peak_tflops(dtype: str, override: float | None) -> tuple[float, str]:
  """(peak TFLOP/s, where it comes from): the flag, the known peak of the accelerator, or a
  measured large-matmul rate (CPU and unknown devices)."""
  if override:
    return override, "--peak_tflops"
  kind = jax.devices()[0].device_kind
  for name, bf16, fp32 in KNOWN_PEAKS:
    if name in kind:
      peak = bf16 if dtype == "bfloat16" else fp32
      return peak, f"known dense {dtype} peak of {kind}"
  size = 2048
  rate = matmul_tflops(size, dtype)
  return rate, f"measured: best of 5 {size}x{size} @ {size}x{size} {dtype} matmuls"


def matmul_tflops(size: int, dtype: str) -> float:
  a = jnp.ones((size, size), dtype)
  matmul = jax.jit(lambda x, y: x @ y)
  matmul(a, a).block_until_ready()
  best = min(time_interleaved({"matmul": lambda: matmul(a, a).block_until_ready()}, 1,
                              5)["matmul"])
  return 2 * size ** 3 / best / 1e12


def load_average() -> list[float] | None:
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except OSError:
    return None


# ------------------------------------------------------------------------------- output
def stamp() -> dict[str, Any]:
  return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
          "command": " ".join([os.path.basename(sys.executable), "-m",
                               sys.modules["__main__"].__spec__.name if
                               getattr(sys.modules["__main__"], "__spec__", None) else
                               sys.argv[0]] + sys.argv[1:]),
          "load_average": load_average(), "device": device_info()}


def emit(result: dict[str, Any], rows: list[tuple[str, str]]) -> None:
  """Prints `result` as one JSON object (--json) or `rows` as a two-column table."""
  if FLAGS.json:
    print(json.dumps(result, default=float))
    return
  width = max(len(k) for k, _ in rows)
  for key, value in rows:
    print(f"{key:<{width}}  {value}")


def fmt_ms(stats: dict[str, float]) -> str:
  return (f"{stats['median']:.1f} ms median (min {stats['min']:.1f}, max {stats['max']:.1f}, "
          f"n={stats['n']})")
