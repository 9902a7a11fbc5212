"""The manifest of a checkpoint, and reading its items.

The manifest ({"step", "leaves": {item: {path: {"shape", "dtype", "fingerprint"}}}}) gives
two checks that do not depend on Orbax's metadata format: a state of a different structure
(another model shape or optimizer) is refused before any array is read, naming the config
fields that differ (IncompatibleCheckpointError); and each restored array must match the
fingerprint taken when it was saved (DamagedCheckpointError). A truncated file fails to read;
a flipped bit reads fine and only the fingerprint notices it.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath

from transformer_jax.errors import UserError
from transformer_jax.trees import flatten, named_leaves


class IncompatibleCheckpointError(UserError):
  """The checkpoint holds a state of another structure than the current config builds."""


class DamagedCheckpointError(UserError, RuntimeError):
  """A checkpoint could not be read back as it was written."""


# ------------------------------------------------------------------------- fingerprints
def _leaf_fingerprint(x: jax.Array) -> jax.Array:
  """Two uint32 sums of the array's bits, plain and position-weighted (mod 2**32): any single
  flipped bit changes the first; swapped values change the second."""
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
  bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).ravel()
  weights = jnp.arange(1, bits.size + 1, dtype=jnp.uint32)
  return jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * weights, dtype=jnp.uint32)])


# Jitted per leaf rather than over the whole tree: a model has few distinct leaf shapes (and
# the Adam moments repeat the parameters'), so this compiles a few tiny programs instead of
# one large one (seconds on a CPU for the whole state).
_fingerprint = jax.jit(_leaf_fingerprint)


def signature(tree: Any) -> dict[str, dict[str, Any]]:
  """{leaf path: {"shape", "dtype"}} of a tree of arrays or ShapeDtypeStructs."""
  return {path: {"shape": list(leaf.shape), "dtype": str(jnp.dtype(leaf.dtype))}
          for path, leaf in named_leaves(tree)}


def describe(tree: Any) -> dict[str, dict[str, Any]]:
  """signature(tree) plus each leaf's fingerprint (this waits for the arrays)."""
  described = signature(tree)
  paths = named_leaves(tree)
  # One leaf at a time: several small collective programs in flight at once can deadlock
  # XLA:CPU's in-process all-reduce on a multi-device mesh.
  prints = [jax.device_get(_fingerprint(leaf)) for _, leaf in paths]
  for (path, _), fingerprint in zip(paths, prints):
    described[path]["fingerprint"] = [int(v) for v in fingerprint]
  return described


# --------------------------------------------------------------------- manifest checks
def without_fingerprints(leaves: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
  """A manifest item's leaves as `signature` gives them."""
  return {p: {k: v for k, v in d.items() if k != "fingerprint"} for p, d in leaves.items()}


def differing(a: dict, b: dict) -> list[str]:
  """The keys whose values differ between `a` and `b` (absent counts as differing), sorted."""
  return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def describe_leaf(leaf: dict | None) -> str:
  """A signature entry as 'float32[64, 64]', or 'absent'."""
  return "absent" if leaf is None else f"{leaf['dtype']}{leaf['shape']}"


def verify(item: str, tree: Any, manifest: dict, where: str) -> None:
  """Raises DamagedCheckpointError unless each array of `tree` has the fingerprint that the
  manifest recorded for `item` when it was saved."""
  expected = manifest["leaves"][item]
  bad = differing(expected, describe(tree))
  if bad:
    raise DamagedCheckpointError(
        f"{where}: {item}/{bad[0]} does not match the fingerprint recorded when it was saved "
        f"({len(bad)} of {len(expected)} arrays differ)")


def config_differences(saved: dict, current: dict) -> list[str]:
  """'field: saved -> current' for each config field that differs."""
  old, new = flatten(saved, "."), flatten(current, ".")
  return [f"{k}: {old.get(k, '<absent>')!r} -> {new.get(k, '<absent>')!r}"
          for k in sorted(set(old) | set(new)) if old.get(k, "<absent>") != new.get(k, "<absent>")]


def check_compatible(path: epath.Path, manifest: dict, saved_config: dict,
                     saved_tokenizer: dict, expected: dict[str, dict], config: dict,
                     tokenizer: dict) -> None:
  """Raises IncompatibleCheckpointError if the checkpoint's arrays (`expected`: {item:
  signature}) or tokenizer differ from what the current config builds."""
  problems = []
  for item, leaves in expected.items():
    saved = without_fingerprints(manifest["leaves"][item])
    paths = differing(saved, leaves)
    problems += [f"{item}/{p}: {describe_leaf(saved.get(p))} -> {describe_leaf(leaves.get(p))}"
                 for p in paths[:3]]
    if len(paths) > 3:
      problems.append(f"... and {len(paths) - 3} more arrays of {item}")
  if saved_tokenizer != tokenizer:
    problems.append("the tokenizer differs from the one the checkpoint was trained with")
  if problems:
    fields = config_differences(saved_config, config) or ["(none)"]
    raise IncompatibleCheckpointError(
        f"cannot resume from {path}: the current config builds a different model or "
        "optimizer state than the one saved there.\nConfig fields that differ from the "
        "checkpoint's (saved -> now):\n  " + "\n  ".join(fields) + "\nWhat differs "
        "(saved -> now):\n  " + "\n  ".join(problems) + "\nResume with the checkpoint's "
        "values of these fields, or train in a new --workdir.")


# ------------------------------------------------------------------------------ reading
def absolute(path: str | epath.Path) -> epath.Path:
  """Local paths made absolute (Orbax needs that); URLs such as gs://... as they are."""
  return epath.Path(path if "://" in str(path) else os.path.abspath(path))


def checkpointer(alone: bool = False) -> ocp.Checkpointer:
  """A composite checkpointer that every process of a cluster calls together; or, `alone`,
  one that process 0 calls by itself while the others do something else (Orbax's barriers
  then wait for no other process; its item handlers write from process 0)."""
  if not alone:
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  if jax.process_index() != 0:
    raise ValueError(f"process {jax.process_index()}: only process 0 reads and writes alone")
  only_0 = ocp.options.MultiprocessingOptions(primary_host=0, active_processes={0})
  handler = ocp.CompositeCheckpointHandler(
      composite_options=ocp.CompositeOptions(multiprocessing_options=only_0))
  return ocp.Checkpointer(handler, multiprocessing_options=only_0)


def read(path: str | epath.Path, alone: bool = False, **items: ocp.args.CheckpointArgs) -> Any:
  """The named items of the composite checkpoint at `path`, read as `items` say (by
  process 0 alone if `alone`: see `checkpointer`)."""
  with checkpointer(alone) as reader:
    return reader.restore(absolute(path), args=ocp.args.Composite(**items))
