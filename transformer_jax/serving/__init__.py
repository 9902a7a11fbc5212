"""Served models: a trained model written as an artifact directory, loaded without Flax or
the model code, and turned from text lines into text lines.

  python -m transformer_jax.export --workdir=W --format=stablehlo --output=DIR
  served = Served.load(DIR); served.predict(["a line", ...])
  python -m transformer_jax.serve --model=DIR --port=P      (HTTP: transformer_jax/serve.py)

  artifact.py   the directory every format shares: tokenizers, labels, manifest, checksums
  lines.py      `Served`: encoding, length buckets, padding, outputs to text (any format)
  stablehlo.py  the StableHLO format (`jax.export`): writer and loader
  batching.py   the server's batcher: the lines of concurrent requests in one model call
  server.py     the HTTP handler (serve.py is the command)

A new format is one more loader module: a writer that calls `artifact.write_directory`
with its model files, and a `load(directory, manifest, max_rows) -> Served` giving `Served`
the model's function; its row in LOADERS below makes `Served.load` read it.

Lines are featurized as predict does (tokenized, grouped in the same length buckets,
padded to the bucket length), so a served model's outputs equal predict's. These modules
import only jax, numpy, sentencepiece and flax-free parts of this package (config, inputs,
bio, data.tokenizer; `transformer_jax/__init__.py` imports Flax lazily).
"""

from __future__ import annotations

from typing import Any, Callable

from transformer_jax.serving import stablehlo
from transformer_jax.serving.artifact import MANIFEST_FILE, ArtifactError, read_json
from transformer_jax.serving.lines import DEFAULT_MAX_ROWS, OUTPUTS, EncodedLine, Served
from transformer_jax.serving.stablehlo import write_artifact

__all__ = ["ArtifactError", "DEFAULT_MAX_ROWS", "EncodedLine", "LOADERS", "OUTPUTS",
           "Served", "load", "write_artifact"]

# Manifest "format" -> its loader: (directory, manifest, max_rows) -> Served.
LOADERS: dict[str, Callable[[str, dict[str, Any], int], Served]] = {
    stablehlo.FORMAT: stablehlo.load}


def load(directory: str, max_rows: int = DEFAULT_MAX_ROWS) -> Served:
  """Reads and checks the artifact in `directory` with its format's loader; ArtifactError
  naming the problem."""
  manifest = read_json(directory, MANIFEST_FILE)
  loader = LOADERS.get(str(manifest.get("format"))) if isinstance(manifest, dict) else None
  if loader is None:
    fmt = manifest.get("format") if isinstance(manifest, dict) else None
    raise ArtifactError(f"{directory}: format {fmt!r} is not one this package reads "
                        f"({sorted(LOADERS)}); export the model again")
  return loader(directory, manifest, max_rows)
