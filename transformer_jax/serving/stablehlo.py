"""The StableHLO format: a trained model as a serialized `jax.export.Exported`, its writer
and its loader.

  python -m transformer_jax.export --workdir=W --format=stablehlo --output=DIR
  served = Served.load(DIR); served.predict(["a line", ...])

Besides the files of every artifact (serving/artifact.py), the directory holds
  model.jax_exported  the serialized `jax.export.Exported` of the task's whole inference
                      function (`Task.serving_function`: translation = encode + beam or
                      greedy search with its while_loop and KV cache; classification = class
                      logits; tagging = per-token log-probabilities), traced with symbolic
                      batch and length, so one artifact serves any batch and any length up
                      to the model's max_len. Its arguments: the parameters as a flat list
                      (in manifest order), then the token ids (batch, length) int32, and for
                      a model with character features each word's bytes (batch, length,
                      word_bytes) int32 (inputs.character_ids of the line's words).
  params.npz          the parameters, one array per name: arguments, not constants, so the
                      module stays small and the weights can be swapped.
  prefill.jax_exported, step.jax_exported, score.jax_exported
                      a language model's streaming programs (`Task.streaming_programs`:
                      sampling.prefill, sampling.step and sampling.score, with symbolic rows
                      and length; the server runs them as serving/slots.py says), the
                      parameters first too.
and the manifest adds the inputs' and output's shapes and dtypes, the parameters' names,
shapes and dtypes, the JAX version, calling convention and platforms, and for a language
model "streaming": those files and its cache's arrays (shapes with "rows" and "length").

Loading imports only jax and numpy besides the format-neutral parts, so serving needs
neither Flax nor the model code; the writer takes an already built task and parameters and
imports nothing more either.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import trees
from transformer_jax.config import PAD_ID
from transformer_jax.serving import artifact
from transformer_jax.serving.artifact import ArtifactError
from transformer_jax.serving.line_policy import LinePolicy
from transformer_jax.serving.lines import DEFAULT_MAX_ROWS, Served
from transformer_jax.serving.slots import LENGTH, ROWS, StreamingPrograms

# Version 2: a language model's function takes each prompt as `prompt_ids` encodes it (1 added
# BOS itself); 3: its streaming programs report log-probabilities and it has a "score"
# program. An older artifact is refused, to be exported again.
FORMAT, FORMAT_VERSION = "transformer_jax.stablehlo", 3
MODEL_FILE, PARAMS_FILE = "model.jax_exported", "params.npz"
# A language model's streaming programs (serving/slots.py), besides its whole function.
STREAMING_FILES = {"prefill": "prefill.jax_exported", "step": "step.jax_exported",
                   "score": "score.jax_exported"}

# jax.devices() platform names -> jax.export platform names.
_EXPORT_PLATFORM = {"gpu": "cuda"}


# ----------------------------------------------------------------------------- writing
def _storable(x: np.ndarray) -> np.ndarray:
  """NumPy's .npz has no bfloat16: such arrays are stored as same-width unsigned ints and
  viewed back on load (the manifest keeps the real dtype)."""
  if x.dtype.type is np.void or x.dtype.name not in np.sctypeDict:
    return x.view(f"u{x.dtype.itemsize}")
  return x


def write_artifact(task: Any, params: Any, decode: Any, output: str, *,
                   platforms: Sequence[str] | None = None,
                   source: dict[str, Any] | None = None,
                   lines: LinePolicy | None = None) -> dict[str, Any]:
  """Exports `task` (a tasks.Task with its tokenizers and labels) with `params` and the
  decode options `decode` to the new directory `output`; returns the manifest. `platforms`:
  jax.export platforms (default: this machine's). `source`: provenance for the manifest.
  `lines`: what the server does to a line, as the model's training did (default: refuse
  long lines, keep markup)."""
  if os.path.exists(output) and os.listdir(output):    # before the export's minutes
    raise FileExistsError(f"{output} exists and is not empty; choose another --output")
  # The names are the params.npz keys and the manifest's "params".
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  names = [trees.path_name(path) for path, _ in leaves]
  arrays = [np.asarray(x) for _, x in leaves]
  word_bytes = task.serving_word_bytes()
  param_specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays]

  def export(function: Any, inputs: list[Any]) -> jax.export.Exported:
    """`function(params, *inputs)` exported with the parameters as a flat list."""
    def flat(flat_params: list[jax.Array], *args: Any) -> Any:
      return function(jax.tree_util.tree_unflatten(treedef, flat_params), *args)
    return jax.export.export(jax.jit(flat), platforms=list(platforms) if platforms else None)(
        param_specs, *inputs)

  batch, length = jax.export.symbolic_shape("batch, length")
  inputs = [jax.ShapeDtypeStruct((batch, length), jnp.int32)]
  if word_bytes:
    inputs.append(jax.ShapeDtypeStruct((batch, length, word_bytes), jnp.int32))
  exported = export(task.serving_function(decode), inputs)
  streaming = task.streaming_programs(params, *jax.export.symbolic_shape(f"{ROWS}, {LENGTH}"))
  programs = {name: export(*streaming[name]) for name in STREAMING_FILES} if streaming else {}

  def write_model(directory: str) -> dict[str, Any]:
    for name, program in ((MODEL_FILE, exported),
                          *((STREAMING_FILES[k], p) for k, p in programs.items())):
      with open(os.path.join(directory, name), "wb") as f:
        f.write(program.serialize())
    storable: dict[str, Any] = {n: _storable(x) for n, x in zip(names, arrays)}
    np.savez(os.path.join(directory, PARAMS_FILE), **storable)
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "inputs": {"params": "the arrays of params.npz, in the order of 'params'",
                   "tokens": {"shape": ["batch", "length"], "dtype": "int32",
                              "padding": PAD_ID},
                   **({"chars": {"shape": ["batch", "length", word_bytes], "dtype": "int32",
                                 "padding": 0, "values": "UTF-8 bytes + 1 of each word"}}
                      if word_bytes else {})},
        "output_shape": [str(d) for d in exported.out_avals[0].shape],
        "output_dtype": str(exported.out_avals[0].dtype),
        "params": [{"name": n, "shape": list(x.shape), "dtype": x.dtype.name}
                   for n, x in zip(names, arrays)],
        "jax_version": jax.__version__,
        "calling_convention_version": exported.calling_convention_version,
        "platforms": list(exported.platforms),
        **({"streaming": {**STREAMING_FILES, "cache": [
            {"shape": [d if isinstance(d, int) else str(d) for d in leaf.shape],
             "dtype": leaf.dtype.name} for leaf in streaming["cache"]]}} if streaming else {}),
    }
  return artifact.write_directory(task, params, decode, output, write_model, source=source,
                                  lines=lines or LinePolicy())


# ----------------------------------------------------------------------------- reading
def load(directory: str, manifest: dict[str, Any],
         max_rows: int = DEFAULT_MAX_ROWS) -> Served:
  """The artifact in `directory` (whose `manifest` read_manifest checked), with its files
  checked against the manifest's SHA-256 and its parameters against the exported
  function's signature; ArtifactError naming the problem."""
  artifact.check_format(directory, manifest, FORMAT, FORMAT_VERSION)
  artifact.check_files(directory, manifest)
  platform = jax.devices()[0].platform
  platform = _EXPORT_PLATFORM.get(platform, platform)
  if platform not in manifest["platforms"]:
    raise ArtifactError(f"{directory} was exported for {manifest['platforms']}, not "
                        f"{platform}; export again with --platforms={platform}")
  exported = _deserialize(directory, MODEL_FILE)
  with np.load(os.path.join(directory, PARAMS_FILE)) as stored:
    arrays = [stored[p["name"]].view(jnp.dtype(p["dtype"])) for p in manifest["params"]]
  for spec, array, aval in zip(manifest["params"], arrays, exported.in_avals[:len(arrays)]):
    if tuple(array.shape) != tuple(aval.shape) or array.dtype != aval.dtype:
      raise ArtifactError(f"{directory}: parameter {spec['name']} is {array.dtype}"
                          f"{list(array.shape)}, the exported function takes "
                          f"{aval.dtype}{list(aval.shape)}")
  params = [jax.device_put(a) for a in arrays]
  call = jax.jit(exported.call)   # compiles once per (rows, length) shape

  def function(tokens: np.ndarray, chars: np.ndarray | None = None) -> np.ndarray:
    extra = [] if chars is None else [jnp.asarray(chars, jnp.int32)]
    return np.asarray(call(params, jnp.asarray(tokens, jnp.int32), *extra))
  streaming = manifest.get("streaming")
  if streaming:
    prefill, step, score = (_deserialize(directory, streaming[name]).call
                            for name in STREAMING_FILES)
    return Served(directory, manifest, function, max_rows, streaming=StreamingPrograms(
        params, prefill, step, score, streaming["cache"], int(manifest["max_len"])))
  return Served(directory, manifest, function, max_rows)


def _deserialize(directory: str, name: str) -> jax.export.Exported:
  with open(os.path.join(directory, name), "rb") as f:
    return jax.export.deserialize(bytearray(f.read()))
