"""Benchmark of decoding: sentences/s and tokens/s for greedy and beam search, with the KV
cache and without it (recomputing the decoder over the output prefix at every step).

  python -m benchmarks.decode --config=benchmarks/configs/multi30k_size.py \
      --batch_size=32 --max_length=64 --beam_size=4 [--json]

Each search is one jitted call over a batch of random source sentences (random
parameters), timed to block_until_ready after warm-up, the four searches in turns (so that
they see the same load on a shared machine); tokens counts the output tokens up to and
including EOS. Without the cache every step decodes the whole (max_length) output buffer,
positions past the current one being PAD, which the decoder masks: one compilation, the same
outputs as the cache (tests/test_decoding.py), and the work a fixed-shape program without a
cache has to do.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import numpy as np
from absl import flags, logging

from benchmarks import common
from transformer_jax import decoding, errors
from transformer_jax.config import EOS_ID, PAD_ID
from transformer_jax.modules.models import Transformer

flags.DEFINE_integer("max_length", 64, "Output length (decoding steps).")
flags.DEFINE_integer("beam_size", 4, "Beam size of the beam-search rows.")
flags.DEFINE_float("alpha", 0.6, "Length penalty of beam search.")
FLAGS = flags.FLAGS


def output_tokens(out: np.ndarray) -> int:
  """Tokens up to and including the first EOS of each row (the whole row without one)."""
  has_eos = (out == EOS_ID).any(1)
  lengths = np.where(has_eos, np.argmax(out == EOS_ID, 1) + 1, (out != PAD_ID).sum(1))
  return int(lengths.sum())


def prepare(s: common.Setup, params: Any, src: Any, beam_size: int,
            use_cache: bool) -> tuple[dict[str, Any], Callable[[], None]]:
  """Compiles one search: (facts, including its output length, and a call that runs it)."""
  search = decoding.compiled_search(s.model, beam_size, FLAGS.alpha, FLAGS.max_length,
                                    use_cache)
  compiled, compile_times = common.compile_jitted(search, params, src)
  tokens = output_tokens(np.asarray(compiled(params, src)))
  info = {"beam_size": beam_size, "kv_cache": use_cache, **compile_times,
          "output_tokens": tokens, "mean_output_length": tokens / src.shape[0]}
  return info, lambda: compiled(params, src).block_until_ready()


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise errors.UserError(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)
  s = common.setup()
  if s.task != "seq2seq":
    raise errors.UserError(f"task={s.task!r}: benchmarks.decode times translation's greedy and "
                           "beam search; give a seq2seq config")
  if FLAGS.max_length > s.model.max_len:
    raise errors.UserError(f"--max_length={FLAGS.max_length} exceeds model.max_len="
                           f"{s.model.max_len}; pass --config.model.max_len")
  src = common.random_batch(s, FLAGS.seed)["src"]
  params = jax.jit(lambda key: nn.meta.unbox(Transformer(s.model).init(
      key, src[:1], src[:1, :1])["params"]))(jax.random.PRNGKey(FLAGS.seed))
  src = jax.device_put(src)
  prepared = {(beam, cache): prepare(s, params, src, beam, cache)
              for beam in (1, FLAGS.beam_size) for cache in (True, False)}
  times = common.time_interleaved({key: call for key, (_, call) in prepared.items()},
                                  FLAGS.warmup, FLAGS.steps, FLAGS.block)
  runs = []
  for key, (info, _) in prepared.items():
    seconds = float(np.median(times[key]))
    runs.append({**info, "call_time_ms": common.stats_ms(times[key]),
                 "sentences_per_sec": src.shape[0] / seconds,
                 "tokens_per_sec": info["output_tokens"] / seconds})
  speedups = {}
  for beam in (1, FLAGS.beam_size):
    cached, recomputed = (r for r in runs if r["beam_size"] == beam)
    speedups[f"beam_{beam}"] = cached["sentences_per_sec"] / recomputed["sentences_per_sec"]
  result = {"benchmark": "decode", **common.stamp(), "model": s.model.to_dict(),
            "batch_size": s.batch_size, "src_length": s.src_length,
            "max_length": FLAGS.max_length, "runs": runs, "kv_cache_speedup": speedups}
  rows = [("device", f"{result['device']['kind']} ({result['device']['platform']}), "
                     f"load average {result['load_average']}"),
          ("problem", f"{s.batch_size} sources of {s.src_length} tokens, output length "
                      f"{FLAGS.max_length}, d_model {s.model.d_model}, "
                      f"{s.model.num_encoder_layers}+{s.model.num_decoder_layers} layers, "
                      f"{s.model.dtype}")]
  for r in runs:
    name = ("greedy" if r["beam_size"] == 1 else f"beam {r['beam_size']}") + (
        ", KV cache" if r["kv_cache"] else ", recompute")
    rows.append((name, f"{r['sentences_per_sec']:,.1f} sentences/s, "
                       f"{r['tokens_per_sec']:,.0f} tokens/s, {common.fmt_ms(r['call_time_ms'])}, "
                       f"compile {r['compile_s']:.1f} s"))
  rows.append(("KV cache speedup", ", ".join(f"{k.replace('_', ' ')}: {v:.2f}x"
                                             for k, v in speedups.items())))
  common.emit(result, rows)


if __name__ == "__main__":
  errors.run(main)
