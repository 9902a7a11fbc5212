"""The programs of a training run, built as train.py builds them, with abstract arguments.

The run config reaches aot as the ml_collections config or the `RunOptions` parsed from it
(transformer_jax/options.py, as train.py parses it): `run_settings`, `experiment_for` and
`build_programs` read those options; everything else in aot gets `RunSettings`, the
`Experiment` or the `Program`s made here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from transformer_jax import decoding, lora, sharding
from transformer_jax.aot.targets import UsageError
from transformer_jax.data.sources import training_widths
from transformer_jax.data.synthetic import SyntheticData
from transformer_jax.flops import lm_flops, model_flops
from transformer_jax.modules.models import LanguageModel
from transformer_jax.options import DataOptions, RunOptions
from transformer_jax.training.experiment import Experiment

PROGRAMS = ("train_step", "eval_step", "decode")


@dataclasses.dataclass(frozen=True)
class RunSettings:
  """What aot reads from the run config besides its programs: for headers, the batch
  search and the "does not fit" advice."""
  batch_size: int                  # global rows per step
  grad_accum_steps: int
  max_length: int                  # data.max_length: tokens per training row
  remat_policy: str
  eval_batch_size: int
  mesh: dict[str, int]             # the config's (data, fsdp, tensor) sizes
  vocab_size: int


@dataclasses.dataclass(frozen=True)
class Program:
  """One jitted function of a training run and abstract arguments to compile it for;
  `model_flops` (the project's formula, all chips) and `tokens` (array tokens, padding
  included) per call, None where the formula does not apply (decoding)."""
  name: str
  fn: Any                     # a jitted function: .lower(*args)
  args: tuple
  model_flops: int | None
  tokens: int | None


def run_settings(config: Any) -> RunSettings:
  options = RunOptions.parse(config)
  return RunSettings(
      batch_size=options.train.batch_size, grad_accum_steps=options.train.grad_accum_steps,
      max_length=options.data.max_length,
      remat_policy=options.model.get("remat_policy", "none"),
      eval_batch_size=options.eval.batch_size, mesh=options.mesh.sizes(),
      vocab_size=_vocab_size(options.data))


def with_batch(config: Any, batch_size: int) -> RunOptions:
  """The run with another global batch size (the batch search)."""
  return RunOptions.parse(config).with_batch_size(batch_size)


def _vocab_size(data: DataOptions) -> int:
  """The vocabulary size a run would get, without reading data or training a tokenizer:
  the synthetic task's fixed symbols, or the SentencePiece size in the config."""
  if data.synthetic:
    from transformer_jax.data.synthetic import make_vocab
    return make_vocab().vocab_size
  if data.tokenizer != "sentencepiece":
    raise UsageError(f"data.tokenizer={data.tokenizer!r}: its vocabulary size is known only "
                     "after reading the data; aot needs a SentencePiece or synthetic config")
  return int(data.vocab_size)


def experiment_for(config: Any, mesh: jax.sharding.Mesh) -> Experiment:
  """The run's setup as train.py builds it, on `mesh`, without reading any data."""
  options = RunOptions.parse(config)
  vocab_size = _vocab_size(options.data)
  separate = None if options.data.shared_vocab else vocab_size
  experiment = Experiment.create(options, data=False, vocab_sizes=(vocab_size, separate),
                                 mesh=mesh)
  if not (experiment.task.has_target_text or decoder_only(experiment)):
    raise UsageError(f"task={options.train.task!r}: aot compiles translation (seq2seq) "
                     "and language model (lm) configs")
  return experiment


def decoder_only(experiment: Experiment) -> bool:
  """Whether the run's model is the decoder-only language model (one sequence a row)."""
  return isinstance(experiment.task.model, LanguageModel)


def _counts(experiment: Experiment, rows: int, src_len: int, tgt_len: int,
            training: bool = True) -> tuple[int, int]:
  """(model FLOPs, array tokens) of one call on `rows` rows: a source of `src_len` and a
  target of `tgt_len` tokens, or for a language model one sequence of `tgt_len`."""
  cfg = experiment.model_config
  if decoder_only(experiment):
    return lm_flops(cfg, rows, tgt_len, training)["total"], rows * tgt_len
  return model_flops(cfg, rows, src_len, tgt_len, training)["total"], rows * (src_len + tgt_len)


def build_programs(config: Any, mesh: jax.sharding.Mesh,
                   names: tuple[str, ...] = PROGRAMS) -> list[Program]:
  """The jitted programs of a training run (train.py) with abstract, sharded arguments:
  the train step on a `batch_size` x `data.max_length` batch with the donated, sharded
  state; the eval step on the longest evaluation bucket; beam search as evaluation runs it
  (parameters in their training layout, the source rows as a host array: replicated, then
  split over the batch axes inside the search; decoding.compiled_search), or for a language
  model, its continuations of eval.batch_size prompts (the task's serving function:
  decode.max_new_tokens drawn through the KV cache, as predict draws them). All three come
  from the run's Experiment, as in train.py."""
  options = RunOptions.parse(config)
  experiment = experiment_for(options, mesh)
  model_cfg = experiment.model_config
  state, state_sharding = experiment.abstract_state()
  params = lora.base(state.params)   # what evaluation and decoding take (LoRA's merged)
  src_len, tgt_len = training_widths(options.data)
  synthetic = options.data.synthetic
  programs = []
  if "train_step" in names:
    rows = options.train.batch_size
    programs.append(Program("train_step", experiment.train_step(state_sharding),
                            (state, _batch(experiment, synthetic, rows, src_len, tgt_len)),
                            *_counts(experiment, rows, src_len, tgt_len)))
  # Synthetic data evaluates at its training widths; text in buckets up to eval_max_length.
  eval_len = options.data.eval_max_length
  eval_src, eval_tgt = (src_len, tgt_len) if synthetic else (eval_len, eval_len)
  # Evaluation pads its batches with empty rows to a multiple of data*fsdp (loop.py).
  ways = sharding.batch_ways(mesh)
  eval_rows = -(-experiment.eval.batch_size // ways) * ways
  if "eval_step" in names:
    programs.append(Program("eval_step", experiment.eval_step(state_sharding.params),
                            (params, _batch(experiment, synthetic, eval_rows, eval_src,
                                                    eval_tgt)),
                            *_counts(experiment, eval_rows, eval_src, eval_tgt, training=False)))
  if "decode" in names and decoder_only(experiment):
    # The served function: the run's decode options, prompts right-padded to eval_src.
    continuations = jax.jit(experiment.task.serving_function(experiment.decode))
    prompts = jax.ShapeDtypeStruct((experiment.eval.batch_size, eval_src), jnp.int32,
                                   sharding=sharding.replicated(mesh))
    programs.append(Program("decode", continuations, (params, prompts), None, None))
  elif "decode" in names:
    decode = experiment.decode
    max_length = min(eval_tgt + decode.max_extra_length, model_cfg.max_len)
    fn = decoding.compiled_search(model_cfg, decode.beam_size, decode.alpha, max_length,
                                  rows=sharding.batch_sharding(mesh))
    src = jax.ShapeDtypeStruct((experiment.eval.batch_size, eval_src), jnp.int32,
                               sharding=sharding.replicated(mesh))
    programs.append(Program("decode", fn, (params, src), None, None))
  return programs


def _batch(experiment: Experiment, synthetic: bool, rows: int, src_len: int,
           tgt_len: int) -> dict[str, jax.ShapeDtypeStruct]:
  """The batch the run feeds, `rows` rows (source `src_len`, target `tgt_len` tokens wide),
  batch-sharded on the experiment's mesh: the task's packed-batch keys, or the synthetic
  data's own (unpacked: no positions or segment ids)."""
  spec = sharding.batch_sharding(experiment.mesh)
  keys = experiment.task.batch_spec(rows, max(src_len, tgt_len))
  if synthetic:
    keys = {k: v for k, v in keys.items() if k in SyntheticData.BATCH_KEYS}
  width = lambda k: src_len if k.startswith("src") else tgt_len
  return {k: jax.ShapeDtypeStruct((rows, width(k)), v.dtype, sharding=spec)
          for k, v in keys.items()}
