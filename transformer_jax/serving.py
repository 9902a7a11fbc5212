"""Served models: a trained model as a StableHLO artifact (`jax.export`), and its loader.

  python -m transformer_jax.export --workdir=W --format=stablehlo --output=DIR
  served = Served.load(DIR); served.predict(["a line", ...])

An artifact directory holds
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
  vocab.json (+ .model), target_vocab.json  the tokenizer files (data/tokenizer.py)
  labels.json         class or tag names, for tasks that have them
  manifest.json       task, output kind, shapes, dtypes, special ids, decode options, JAX
                      version, platforms, a SHA-256 per file and a fingerprint over them,
                      and the task's constants (a CRF tagger's transition scores).

This module imports only jax, numpy, sentencepiece and flax-free parts of this package
(config, inputs, bio, data.tokenizer; `transformer_jax/__init__.py` imports Flax lazily),
so serving needs neither Flax nor the model code. The writer, `write_artifact`, takes an
already built task and parameters and imports nothing more either.

Lines are featurized as predict does: tokenized, grouped in the same length buckets and
padded to the bucket length, so the artifact's outputs equal predict's. Rows are padded to
a power of two (by repeating the last line, which ends a search no later than it), so a
server compiles few shapes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import bio
from transformer_jax.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from transformer_jax.data.tokenizer import TARGET_VOCAB_FILE, VOCAB_FILE, load_tokenizer
from transformer_jax.data.vocab import strip_special
from transformer_jax.inputs import InputError, bucket_lengths, character_ids

FORMAT, FORMAT_VERSION = "transformer_jax.stablehlo", 1
MODEL_FILE, PARAMS_FILE, LABELS_FILE, MANIFEST_FILE = (
    "model.jax_exported", "params.npz", "labels.json", "manifest.json")
DEFAULT_MAX_ROWS = 64


class EncodedLine(NamedTuple):
  """A line as the exported function takes it: its token ids and, for a model with
  character features, its words' bytes (len(ids), word_bytes)."""
  ids: list[int]
  chars: np.ndarray | None = None


class ArtifactError(ValueError):
  """A directory that is not a usable artifact; the message names the file and the fix."""


# ----------------------------------------------------------------------------- writing
def _param_name(path: tuple) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _storable(x: np.ndarray) -> np.ndarray:
  """NumPy's .npz has no bfloat16: such arrays are stored as same-width unsigned ints and
  viewed back on load (the manifest keeps the real dtype)."""
  if x.dtype.type is np.void or x.dtype.name not in np.sctypeDict:
    return x.view(f"u{x.dtype.itemsize}")
  return x


def _sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def _fingerprint(files: dict[str, str]) -> str:
  return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def write_artifact(task: Any, params: Any, decode: Any, output: str, *,
                   platforms: Sequence[str] | None = None,
                   source: dict[str, Any] | None = None) -> dict[str, Any]:
  """Exports `task` (a tasks.Task with its tokenizers and labels) with `params` and the
  decode options `decode` to the new directory `output`; returns the manifest. `platforms`:
  jax.export platforms (default: this machine's). `source`: provenance for the manifest."""
  if os.path.exists(output) and os.listdir(output):
    raise FileExistsError(f"{output} exists and is not empty; choose another --output")
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  names = [_param_name(path) for path, _ in leaves]
  arrays = [np.asarray(x) for _, x in leaves]
  inference = task.serving_function(decode)
  word_bytes = task.serving_word_bytes()

  def flat_inference(flat_params: list[jax.Array], tokens: jax.Array,
                     *chars: jax.Array) -> jax.Array:
    return inference(jax.tree_util.tree_unflatten(treedef, flat_params), tokens, *chars)

  batch, length = jax.export.symbolic_shape("batch, length")
  inputs = [jax.ShapeDtypeStruct((batch, length), jnp.int32)]
  if word_bytes:
    inputs.append(jax.ShapeDtypeStruct((batch, length, word_bytes), jnp.int32))
  exported = jax.export.export(jax.jit(flat_inference),
                               platforms=list(platforms) if platforms else None)(
      [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays], *inputs)

  parent = os.path.dirname(os.path.abspath(output))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".stablehlo-", dir=parent)   # renamed when complete
  try:
    with open(os.path.join(tmp, MODEL_FILE), "wb") as f:
      f.write(exported.serialize())
    np.savez(os.path.join(tmp, PARAMS_FILE), **{n: _storable(x) for n, x in zip(names, arrays)})
    task.tokenizer.save(os.path.join(tmp, VOCAB_FILE))
    if task.target_tokenizer is not task.tokenizer:
      task.target_tokenizer.save(os.path.join(tmp, TARGET_VOCAB_FILE))
    if task.labels is not None:
      with open(os.path.join(tmp, LABELS_FILE), "w") as f:
        json.dump({"labels": task.labels}, f)
    files = {name: _sha256(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))}
    cfg = task.model_config
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "task": task.name, "output": task.serving_output,
        "inputs": {"params": "the arrays of params.npz, in the order of 'params'",
                   "tokens": {"shape": ["batch", "length"], "dtype": "int32",
                              "padding": PAD_ID},
                   **({"chars": {"shape": ["batch", "length", word_bytes], "dtype": "int32",
                                 "padding": 0, "values": "UTF-8 bytes + 1 of each word"}}
                      if word_bytes else {})},
        "word_bytes": word_bytes,
        "constants": task.serving_constants(params),
        "output_shape": [str(d) for d in exported.out_avals[0].shape],
        "output_dtype": str(exported.out_avals[0].dtype),
        "params": [{"name": n, "shape": list(x.shape), "dtype": x.dtype.name}
                   for n, x in zip(names, arrays)],
        "max_len": cfg.max_len, "vocab_size": cfg.vocab_size,
        "target_vocab_size": cfg.tgt_vocab_size,
        "special_ids": {"pad": PAD_ID, "bos": BOS_ID, "eos": EOS_ID, "unk": UNK_ID},
        "decode": dataclasses.asdict(decode),
        "labels": task.labels,
        "jax_version": jax.__version__,
        "calling_convention_version": exported.calling_convention_version,
        "platforms": list(exported.platforms),
        "source": source or {},
        "files": files, "fingerprint": _fingerprint(files),
    }
    with open(os.path.join(tmp, MANIFEST_FILE), "w") as f:
      json.dump(manifest, f, indent=1)
    if os.path.isdir(output):
      os.rmdir(output)          # empty (checked above)
    os.replace(tmp, output)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return manifest


# ----------------------------------------------------------------------------- reading
def _token_ids(served: "Served", out: np.ndarray, lengths: Sequence[int]) -> list[str]:
  return [served.target_tokenizer.decode(strip_special(row)) for row in out]


def _class_scores(served: "Served", out: np.ndarray, lengths: Sequence[int]) -> list[str]:
  return [served.labels[i] for i in out.argmax(-1)]


def _tag_scores(served: "Served", out: np.ndarray, lengths: Sequence[int]) -> list[str]:
  crf = served.constants.get("crf")
  if crf:          # emission scores; the CRF's transitions, always with BIO (as predict)
    scores = (np.asarray(crf["start"]), np.asarray(crf["transitions"]), np.asarray(crf["end"]))
    best = [bio.viterbi(row[:n], *served.transitions, scores=scores)
            for row, n in zip(out, lengths)]
  elif served.decode.get("bio_constrained", True):
    best = [bio.viterbi(row[:n], *served.transitions) for row, n in zip(out, lengths)]
  else:
    best = [row[:n].argmax(-1) for row, n in zip(out, lengths)]
  return [" ".join(served.labels[i] for i in row) for row in best]


# Output kind (Task.serving_output) -> rows of the exported output to text lines.
OUTPUTS: dict[str, Callable[["Served", np.ndarray, Sequence[int]], list[str]]] = {
    "token_ids": _token_ids, "class_scores": _class_scores, "tag_scores": _tag_scores}

# jax.devices() platform names -> jax.export platform names.
_EXPORT_PLATFORM = {"gpu": "cuda"}


def _read_json(directory: str, name: str) -> Any:
  path = os.path.join(directory, name)
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    raise ArtifactError(f"{path} is missing; is {directory} a directory written by "
                        "`python -m transformer_jax.export --format=stablehlo`?") from None
  except json.JSONDecodeError as e:
    raise ArtifactError(f"{path} is not valid JSON ({e}); export the model again") from None


class Served:
  """A loaded artifact: `predict(lines)` gives one output line per input line."""

  def __init__(self, directory: str, manifest: dict[str, Any], exported: Any,
               params: list[jax.Array], max_rows: int = DEFAULT_MAX_ROWS):
    self.directory, self.manifest, self.exported = directory, manifest, exported
    self.params, self.max_rows = params, max_rows
    self.max_len = int(manifest["max_len"])
    self.decode = manifest["decode"]
    self.buckets = bucket_lengths(self.max_len)
    self.labels = manifest.get("labels")
    self.word_bytes = manifest.get("word_bytes")
    self.constants = manifest.get("constants", {})
    self.tokenizer = load_tokenizer(os.path.join(directory, VOCAB_FILE))
    target = os.path.join(directory, TARGET_VOCAB_FILE)
    self.target_tokenizer = load_tokenizer(target) if os.path.exists(target) else self.tokenizer
    self.transitions = bio.allowed_transitions(self.labels) if self.labels else None
    self._outputs = OUTPUTS[manifest["output"]]
    self._call = jax.jit(exported.call)   # compiles once per (rows, length) shape

  @classmethod
  def load(cls, directory: str, max_rows: int = DEFAULT_MAX_ROWS) -> "Served":
    """Reads and checks an artifact (files against the manifest's SHA-256, parameters
    against the exported function's signature); raises ArtifactError naming the problem."""
    manifest = _read_json(directory, MANIFEST_FILE)
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
      raise ArtifactError(f"{directory}: format {manifest.get('format')!r} version "
                          f"{manifest.get('format_version')!r}; this loader reads {FORMAT} "
                          f"version {FORMAT_VERSION}")
    if manifest.get("output") not in OUTPUTS:
      raise ArtifactError(f"{directory}: unknown output kind {manifest.get('output')!r}; "
                          f"known: {sorted(OUTPUTS)}")
    for name, digest in manifest["files"].items():
      path = os.path.join(directory, name)
      if not os.path.exists(path) or _sha256(path) != digest:
        raise ArtifactError(f"{path} is missing or differs from the manifest's SHA-256; "
                            "copy or export the artifact again")
    platform = jax.devices()[0].platform
    platform = _EXPORT_PLATFORM.get(platform, platform)
    if platform not in manifest["platforms"]:
      raise ArtifactError(f"{directory} was exported for {manifest['platforms']}, not "
                          f"{platform}; export again with --platforms={platform}")
    with open(os.path.join(directory, MODEL_FILE), "rb") as f:
      exported = jax.export.deserialize(bytearray(f.read()))
    with np.load(os.path.join(directory, PARAMS_FILE)) as stored:
      arrays = [stored[p["name"]].view(jnp.dtype(p["dtype"])) for p in manifest["params"]]
    expected = exported.in_avals[:len(arrays)]
    for spec, array, aval in zip(manifest["params"], arrays, expected):
      if tuple(array.shape) != tuple(aval.shape) or array.dtype != aval.dtype:
        raise ArtifactError(f"{directory}: parameter {spec['name']} is {array.dtype}"
                            f"{list(array.shape)}, the exported function takes "
                            f"{aval.dtype}{list(aval.shape)}")
    return cls(directory, manifest, exported, [jax.device_put(a) for a in arrays], max_rows)

  @property
  def fingerprint(self) -> str:
    return self.manifest["fingerprint"]

  def encode(self, lines: Sequence[Any]) -> list[EncodedLine]:
    """Token ids (and word bytes) per line; InputError for a line that is not a string,
    that the tokenizer rejects, or that is longer than max_len tokens."""
    encoded = []
    for index, line in enumerate(lines):
      if not isinstance(line, str):
        raise InputError(f"input {index}: expected a string, got {type(line).__name__}")
      try:
        ids = self.tokenizer.encode(line)
      except ValueError as e:    # e.g. a symbol outside a symbol vocabulary
        raise InputError(f"input {index}: {e}") from None
      if len(ids) > self.max_len:
        raise InputError(f"input {index}: {len(ids)} tokens exceed the model's "
                         f"max_len={self.max_len}; shorten or split it")
      # Word-level tokenizers split on whitespace, as the tasks' featurizers do.
      chars = character_ids(line.split(), self.word_bytes) if self.word_bytes else None
      encoded.append(EncodedLine(ids, chars))
    return encoded

  def run(self, tokens: np.ndarray, chars: np.ndarray | None = None) -> np.ndarray:
    """The exported function on a (batch, length) int32 array of checked ids (and, for a
    model with character features, the words' bytes (batch, length, word_bytes))."""
    extra = [] if chars is None else [jnp.asarray(chars, jnp.int32)]
    return np.asarray(self._call(self.params, jnp.asarray(tokens, jnp.int32), *extra))

  def predict(self, lines: Sequence[Any]) -> list[str]:
    """One output per line (a translation, a label, or space-separated tags)."""
    return self.predict_ids(self.encode(lines))

  def predict_ids(self, encoded: Sequence[EncodedLine]) -> list[str]:
    """`predict` for lines already through `encode`."""
    groups: dict[int, list[int]] = {}
    for index, line in enumerate(encoded):   # the buckets of predict (data.pipeline)
      bucket = next(b for b in self.buckets
                    if b >= max(len(line.ids), 1) or b == self.max_len)
      groups.setdefault(bucket, []).append(index)
    outputs = [""] * len(encoded)
    for length, members in sorted(groups.items()):
      for start in range(0, len(members), self.max_rows):
        chunk = members[start:start + self.max_rows]
        rows = min(1 << (len(chunk) - 1).bit_length(), self.max_rows)
        tokens = np.full((rows, length), PAD_ID, np.int32)
        chars = np.zeros((rows, length, self.word_bytes), np.int32) if self.word_bytes else None
        for row, index in enumerate(chunk):
          line = encoded[index]
          tokens[row, :len(line.ids)] = line.ids
          if chars is not None:
            chars[row, :len(line.ids)] = line.chars
        tokens[len(chunk):] = tokens[len(chunk) - 1]     # filler rows repeat the last line
        if chars is not None:
          chars[len(chunk):] = chars[len(chunk) - 1]
        out = self.run(tokens, chars)[:len(chunk)]
        for index, text in zip(chunk, self._outputs(self, out,
                                                    [len(encoded[i].ids) for i in chunk])):
          outputs[index] = text
    return outputs
