"""Naming the leaves of nested trees by their paths: "encoder/layer_0/self_attention/query/kernel".

Two kinds of tree, two functions, because they differ on purpose:
  flatten(tree)       nested dicts (parameter trees, configs), in insertion order; every
                      leaf is kept, None included (a config's None is a value);
  named_leaves(tree)  any JAX pytree, in JAX's flattening order, so that the names line up
                      with jax.tree_util.tree_flatten's leaves (None is an empty subtree).
`path_name` names one JAX key path as named_leaves does; `get_path`/`set_path` address a
nested dict by such a name.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

SEPARATOR = "/"


def path_name(key_path: tuple, separator: str = SEPARATOR) -> str:
  """A JAX key path (from tree_flatten_with_path) as 'a/b/0'."""
  return jax.tree_util.keystr(key_path, simple=True, separator=separator)


def named_leaves(tree: Any, separator: str = SEPARATOR,
                 is_leaf: Callable[[Any], bool] | None = None) -> list[tuple[str, Any]]:
  """[(path name, leaf)] of any pytree, in jax.tree_util.tree_flatten's order."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
  return [(path_name(path, separator), leaf) for path, leaf in leaves]


def flatten(tree: dict, separator: str = SEPARATOR) -> dict[str, Any]:
  """{path name: leaf} of nested dicts; what is not a dict is a leaf."""
  flat: dict[str, Any] = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update({f"{key}{separator}{k}": v for k, v in flatten(value, separator).items()})
    else:
      flat[str(key)] = value
  return flat


def unflatten(flat: dict[str, Any], separator: str = SEPARATOR) -> dict:
  """The nested dicts that `flatten` would give `flat` for."""
  tree: dict = {}
  for path, value in flat.items():
    set_path(tree, path, value, separator)
  return tree


def get_path(tree: dict, path: str, separator: str = SEPARATOR) -> Any:
  """tree[a][b][c] for the path 'a/b/c'."""
  for key in path.split(separator):
    tree = tree[key]
  return tree


def set_path(tree: dict, path: str, value: Any, separator: str = SEPARATOR) -> None:
  """tree[a][b][c] = value for the path 'a/b/c', creating the dicts on the way."""
  *parents, leaf = path.split(separator)
  for key in parents:
    tree = tree.setdefault(key, {})
  tree[leaf] = value
