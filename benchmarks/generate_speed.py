"""Greedy generation speed against transformers' `generate` on this CPU, with the KV cache:
models of GPT-2 small's, TinyLlama's, Qwen2.5-0.5B's and Llama-3.2-1B's shapes (and a toy
GPT-2, "tiny") with random weights, the same weights on both sides (the transformers
model's state_dict through the converter: convert/gpt2.py, convert/llama.py's FAMILY,
convert/qwen.py's FAMILY_QWEN2), new tokens per second at each batch size, and the time to
the first token.

  python -m benchmarks.generate_speed [--models=gpt2,tinyllama,qwen2.5-0.5b,llama3.2-1b]
      [--batches=1,16] [--prompt=64] [--new=256] [--steps=2] [--json]

Each row's prompts are --prompt random token ids, none special (TinyLlama's begin with <s>
and Llama 3.2's with <|begin_of_text|>, as their tokenizers add them; Qwen's and GPT-2's
add none), continued by --new tokens: transformers with `model.generate(input_ids,
attention_mask, do_sample=False)` (its DynamicCache; told not to stop at an end token), ours
with `sampling.compiled_generate` at temperature 0 (what predict runs; it stops a row at EOS
and the loop once every row has: tokens/s counts the steps made). The two are timed in turns
(--steps calls each), in this one process, after --warmup untimed calls each (ours is
compiled before; its compile time is reported apart). The time to the first token is a
whole call for one new token (the prompt's prefill and one draw). Also reported: on how many
rows the two generated the same ids (random weights give near-ties that float rounding can
flip), and the machine's load average (the CPU may be shared: PyTorch's OpenMP threads slow
down far more than XLA's when other work takes the cores, so compare figures taken on a
quiet machine).
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import time
from typing import Any, Callable

from absl import flags

from benchmarks import common
from benchmarks.llama_shapes import SHAPES, word_level_tokenizer
from transformer_jax import errors

FLAGS = flags.FLAGS
# tiny: GPT-2's architecture at toy size (seconds).
MODELS = ("gpt2", "tinyllama", "qwen2.5-0.5b", "llama3.2-1b", "tiny")


def define_flags() -> None:
  """The command-line flags, defined only when this module is the program."""
  flags.DEFINE_list("models", ["gpt2", "tinyllama"],
                    f"Model shapes to time: {', '.join(MODELS)}.")
  flags.DEFINE_list("batches", ["1", "16"], "Batch sizes (rows of prompts).")
  flags.DEFINE_integer("prompt", 64, "Prompt tokens per row.", lower_bound=2)
  flags.DEFINE_integer("new", 256, "New tokens per row.", lower_bound=1)
  flags.DEFINE_integer("torch_threads", None, "torch.set_num_threads for transformers "
                       "(default: torch's own, one per core).", lower_bound=1)
  FLAGS.set_default("steps", 2)     # benchmarks.common's: a TinyLlama call takes minutes
  FLAGS.set_default("warmup", 1)


# --------------------------------------------------------------------------- the models
def gpt2_small(config: Any = None) -> tuple[Any, Any, Any, Any]:
  """(transformers model, our config, our params, tokenizer): GPT-2 small's shape (124M
  parameters: 12 layers, 768 wide, 50,257 tokens, 1,024 positions; or `config`'s, a
  GPT2Config), random weights."""
  import torch
  import transformers

  from transformer_jax.convert import gpt2
  from transformer_jax.data.byte_bpe import END_OF_TEXT, ByteLevelBPE
  config = config or transformers.GPT2Config()
  torch.manual_seed(0)
  model = transformers.GPT2LMHeadModel(config).eval()
  tokenizer = ByteLevelBPE(word_level_tokenizer(config.vocab_size, {config.vocab_size - 1: END_OF_TEXT}))
  ours = gpt2.config_from_hf(config.to_dict(), tokenizer, "gpt2_small")
  state = {k: v.numpy() for k, v in model.state_dict().items()}
  return model, ours, gpt2.state_to_params(state, ours, tokenizer, "gpt2_small"), tokenizer


def llama_shaped(name: str) -> tuple[Any, Any, Any, Any]:
  """(transformers model, our config, our params, tokenizer) of a shape of
  benchmarks/llama_shapes.py, random weights (converted with its family)."""
  import torch
  shape = SHAPES[name]
  torch.manual_seed(0)
  model = shape.model_class()(shape.hf_config()).eval()
  tokenizer = shape.tokenizer()
  ours = shape.our_config(tokenizer)
  state = {k: v.numpy() for k, v in model.state_dict().items()}
  return model, ours, shape.converter().state_to_params(state, ours, tokenizer, name), tokenizer


def tiny() -> tuple[Any, Any, Any, Any]:
  """GPT-2's architecture at 2 layers, 64 wide, 1,000 tokens: the report in seconds."""
  import transformers
  return gpt2_small(transformers.GPT2Config(vocab_size=1000, n_positions=512, n_embd=64,
                                            n_layer=2, n_head=4, bos_token_id=999,
                                            eos_token_id=999))


BUILDERS: dict[str, Callable[[], tuple[Any, Any, Any, Any]]] = {
    "gpt2": gpt2_small, "tiny": tiny,
    **{name: functools.partial(llama_shaped, name)
       for name in ("tinyllama", "qwen2.5-0.5b", "llama3.2-1b")}}
TITLES = {"gpt2": "GPT-2 small (124M)", "tinyllama": "TinyLlama (1.1B)",
          "qwen2.5-0.5b": "Qwen2.5-0.5B", "llama3.2-1b": "Llama-3.2-1B", "tiny": "tiny GPT-2"}


# ------------------------------------------------------------------------------ timing
def _prompts(tokenizer: Any, rows: int, length: int, seed: int) -> Any:
  """(rows, length) of their ids: random tokens that are not special (BOS, EOS, UNK, wherever
  their ids are), after BOS where the tokenizer adds it (Llama's; Qwen's and GPT-2's add
  none)."""
  import numpy as np

  from transformer_jax.data.hf_tokenizer import FIRST_TOKEN
  plain = np.flatnonzero(tokenizer.to_ours(np.arange(tokenizer.size)) >= FIRST_TOKEN)
  ids = plain[np.random.default_rng(seed).integers(0, len(plain), (rows, length))]
  if tokenizer.add_bos:
    ids[:, 0] = tokenizer.bos_id
  return ids


def measure(name: str, batches: list[int], prompt: int, new: int, steps: int,
            warmup: int) -> list[dict[str, Any]]:
  """One row per batch size: both sides' tokens/s and time to the first token."""
  import jax
  import numpy as np
  import torch

  from transformer_jax import sampling
  from transformer_jax.config import PAD_ID
  model, cfg, params, tokenizer = BUILDERS[name]()
  model.generation_config.eos_token_id = None          # every row makes `new` tokens
  model.generation_config.pad_token_id = 0
  params = jax.device_put(params)
  rows = []
  for batch in batches:
    theirs = _prompts(tokenizer, batch, prompt, seed=batch)
    ours = tokenizer.to_ours(theirs).astype(np.int32)
    inputs = torch.from_numpy(theirs)
    mask = torch.ones_like(inputs)

    def hf_call(count: int) -> Callable[[], Any]:
      def call() -> Any:
        with torch.no_grad():
          return model.generate(inputs, attention_mask=mask, do_sample=False,
                                max_new_tokens=count, min_new_tokens=count)[:, prompt:].numpy()
      return call

    compile_s = {}

    def our_call(count: int) -> Callable[[], Any]:
      start = time.perf_counter()
      run = sampling.compiled_generate(cfg, count).lower(
          params, ours, 0.0, 0, 1.0, 0).compile()
      compile_s[count] = time.perf_counter() - start
      return lambda: np.asarray(run(params, ours, 0.0, 0, 1.0, 0))

    calls = {"transformers": hf_call(new), "ours": our_call(new)}
    first = {"transformers": hf_call(1), "ours": our_call(1)}
    ttft = common.time_interleaved(first, warmup=max(1, warmup), steps=max(3, steps))
    times = common.time_interleaved(calls, warmup=warmup, steps=steps)
    mine, theirs_out = calls["ours"](), calls["transformers"]()
    # Ours stops a row at EOS (PAD after it) and the loop once every row has; theirs never.
    made = {"ours": int(max((row != PAD_ID).sum() for row in mine)), "transformers": new}
    same = sum(np.array_equal(tokenizer.to_theirs(a[a != PAD_ID]), b[:(a != PAD_ID).sum()])
               for a, b in zip(mine, theirs_out))
    row = {"model": TITLES[name], "batch": batch, "prompt": prompt, "new": new,
           "compile_s": round(compile_s[new], 1), "same_ids_rows": int(same),
           "ours_steps": made["ours"]}
    for side in calls:
      stats = common.stats_ms(times[side])
      row[side] = {"tokens_per_s": batch * made[side] / (stats["median"] / 1000),
                   "seconds": stats["median"] / 1000, "runs": times[side],
                   "first_token_ms": common.stats_ms(ttft[side])["median"]}
    row["speedup"] = row["ours"]["tokens_per_s"] / row["transformers"]["tokens_per_s"]
    rows.append(row)
  return rows


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise errors.UserError(f"unexpected arguments: {' '.join(argv[1:])}")
  unknown = sorted(set(FLAGS.models) - set(MODELS))
  if unknown:
    raise errors.UserError(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
  try:
    batches = [int(b) for b in FLAGS.batches]
  except ValueError:
    raise errors.UserError(f"--batches={','.join(FLAGS.batches)}: give whole numbers") from None
  if not batches or min(batches) < 1:
    raise errors.UserError("--batches: give at least one batch size, each >= 1")
  try:
    import torch
    import transformers  # noqa: F401
  except ImportError:
    raise errors.UserError("this benchmark needs torch and transformers: pip install -r "
                           "requirements-interop.txt") from None
  if FLAGS.torch_threads:
    torch.set_num_threads(FLAGS.torch_threads)
  rows = [row for name in FLAGS.models
          for row in measure(name, batches, FLAGS.prompt, FLAGS.new, FLAGS.steps,
                             FLAGS.warmup)]
  report = {"date": datetime.date.today().isoformat(), "machine": platform.platform(),
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_average": list(os.getloadavg()), "rows": rows}
  if FLAGS.json:
    print(json.dumps(report))
    return
  print(f"{'model':20s} {'batch':>5s} {'transformers':>13s} {'ours':>10s} {'ours/theirs':>11s} "
        f"{'first token (theirs / ours)':>28s} {'same ids':>9s}")
  for row in rows:
    print(f"{row['model']:20s} {row['batch']:5d} "
          f"{row['transformers']['tokens_per_s']:9.1f} t/s {row['ours']['tokens_per_s']:6.1f} t/s "
          f"{row['speedup']:10.2f}x "
          f"{row['transformers']['first_token_ms']:15.0f} / {row['ours']['first_token_ms']:.0f} ms "
          f"{row['same_ids_rows']:5d}/{row['batch']}")


if __name__ == "__main__":
  define_flags()
  errors.run(main)
