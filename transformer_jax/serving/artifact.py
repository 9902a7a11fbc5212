"""An artifact directory, whatever format its model is in: the tokenizer files, the labels,
a manifest with a SHA-256 per file and a fingerprint over them. A format's writer adds its
model files (and manifest fields) through `write_directory`; its loader reads the checked
manifest with `read_manifest`.

  vocab.json (+ .model), target_vocab.json  the tokenizer files (data/tokenizer.py)
  labels.json         class or tag names, for tasks that have them
  manifest.json       format, task, output kind, max_len, special ids, decode options, the
                      line policy ("lines": too_long, truncate, br_tags), the task's
                      constants (a CRF tagger's transition scores), provenance, the files'
                      SHA-256 and fingerprint, and the format's own fields.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from typing import Any, Callable

from transformer_jax.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from transformer_jax.data.tokenizer import TARGET_VOCAB_FILE, VOCAB_FILE
from transformer_jax.serving.line_policy import LinePolicy

LABELS_FILE, MANIFEST_FILE = "labels.json", "manifest.json"


class ArtifactError(ValueError):
  """A directory that is not a usable artifact; the message names the file and the fix."""


def sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def _fingerprint(files: dict[str, str]) -> str:
  return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def write_directory(task: Any, params: Any, decode: Any, output: str,
                    write_model: Callable[[str], dict[str, Any]], *,
                    source: dict[str, Any] | None = None,
                    lines: LinePolicy | None = None) -> dict[str, Any]:
  """Writes the artifact of `task` (a tasks.Task with its tokenizers and labels) with
  `params` and the decode options `decode` to the new directory `output`, atomically (a
  temporary directory renamed when complete). `write_model(directory)` writes the format's model files and returns its manifest fields
  (at least "format" and "format_version"); `lines`: what the server does to an input line
  (serving/line_policy.py; default: refuse long lines, keep markup). Returns the manifest."""
  if os.path.exists(output) and os.listdir(output):
    raise FileExistsError(f"{output} exists and is not empty; choose another --output")
  parent = os.path.dirname(os.path.abspath(output))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".artifact-", dir=parent)
  try:
    model_fields = write_model(tmp)
    task.tokenizer.save(os.path.join(tmp, VOCAB_FILE))
    if task.target_tokenizer is not task.tokenizer:
      task.target_tokenizer.save(os.path.join(tmp, TARGET_VOCAB_FILE))
    if task.labels is not None:
      with open(os.path.join(tmp, LABELS_FILE), "w") as f:
        json.dump({"labels": task.labels}, f)
    files = {name: sha256(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))}
    cfg = task.model_config
    manifest = {
        **model_fields,
        "task": task.name, "output": task.serving_output,
        "max_len": cfg.max_len, "vocab_size": cfg.vocab_size,
        "target_vocab_size": cfg.tgt_vocab_size,
        # "end": the ids that end a text (EOS and a language model's further end tokens).
        "special_ids": {"pad": PAD_ID, "bos": BOS_ID, "eos": EOS_ID, "unk": UNK_ID,
                        "end": [EOS_ID, *cfg.end_ids]},
        "decode": dataclasses.asdict(decode),
        "lines": (lines or LinePolicy()).manifest(),
        "labels": task.labels,
        "word_bytes": task.serving_word_bytes(),
        "constants": task.serving_constants(params),
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


def read_json(directory: str, name: str) -> Any:
  path = os.path.join(directory, name)
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    raise ArtifactError(f"{path} is missing; is {directory} a directory written by "
                        "`python -m transformer_jax.export --format=stablehlo`?") from None
  except json.JSONDecodeError as e:
    raise ArtifactError(f"{path} is not valid JSON ({e}); export the model again") from None


def check_files(directory: str, manifest: dict[str, Any]) -> None:
  """Every file the manifest lists is there with its SHA-256, or ArtifactError."""
  for name, digest in manifest["files"].items():
    path = os.path.join(directory, name)
    if not os.path.exists(path) or sha256(path) != digest:
      raise ArtifactError(f"{path} is missing or differs from the manifest's SHA-256; "
                          "copy or export the artifact again")


def check_format(directory: str, manifest: dict[str, Any], name: str, version: int) -> None:
  """The manifest is of format `name` at `version`, or ArtifactError."""
  if manifest.get("format") != name or manifest.get("format_version") != version:
    raise ArtifactError(f"{directory}: format {manifest.get('format')!r} version "
                        f"{manifest.get('format_version')!r}; this loader reads {name} "
                        f"version {version}")
