"""The arrows between modules point one way: the config schema (options.py, config.py) sits
below the data package, which reads it, so the schema never imports from transformer_jax.data."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA_MODULES = ("transformer_jax/options.py", "transformer_jax/config.py")
FORBIDDEN = "transformer_jax.data"


def imported_modules(path: str, root: str = ROOT) -> set[str]:
  """Every module a file imports, at the top or inside a function (a deferred import is
  still an arrow), relative imports resolved against the file's package under `root`."""
  package = os.path.dirname(os.path.relpath(path, root)).replace(os.sep, ".")
  names = set()
  for node in ast.walk(ast.parse(open(path).read(), path)):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        base = f"{parent}.{base}".rstrip(".")
      names.add(base)
      names.update(f"{base}.{alias.name}" for alias in node.names)
  return names


def reaches_data(names: set[str]) -> list[str]:
  return sorted(n for n in names if n == FORBIDDEN or n.startswith(FORBIDDEN + "."))


@pytest.mark.parametrize("module", SCHEMA_MODULES)
def test_schema_module_imports_nothing_from_data(module):
  path = os.path.join(ROOT, module)
  assert imported_modules(path), "the parser found no imports at all: it is broken"
  assert reaches_data(imported_modules(path)) == [], f"{module} imports from {FORBIDDEN}"


def test_the_import_parser_sees_deferred_and_relative_imports(tmp_path):
  """The check above would pass vacuously if these forms went unseen."""
  package = tmp_path / "transformer_jax"
  package.mkdir()
  source = package / "options.py"
  source.write_text("def f():\n  from transformer_jax.data.synthetic import X\n"
                    "from .data import pipeline\nimport transformer_jax.data.vocab\n")
  found = reaches_data(imported_modules(str(source), root=str(tmp_path)))
  assert {"transformer_jax.data.synthetic", "transformer_jax.data",
          "transformer_jax.data.vocab"} <= set(found)


def test_importing_and_using_the_schema_loads_no_data_module():
  """At run time too: building and validating the default config's options (synthetic data
  included, whose task list the schema holds) leaves transformer_jax.data unloaded."""
  code = ("import sys\n"
          "from transformer_jax import options, config\n"
          "from configs import default\n"
          "options.RunOptions.from_config(default.get_config())\n"
          "options.DataOptions(source='synthetic', synthetic_task='add')\n"
          "print([m for m in sys.modules if m.startswith('transformer_jax.data')])\n")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                       text=True, check=True).stdout
  assert out.strip() == "[]"


def test_every_synthetic_task_the_schema_accepts_is_generated():
  """The names moved to the schema; each must still be a task data/synthetic.py makes, with
  a distinct target (a name without its own branch would silently repeat another task)."""
  from transformer_jax.data.synthetic import SyntheticData
  from transformer_jax.options import SYNTHETIC_TASKS
  targets = {}
  for name in SYNTHETIC_TASKS:
    pairs = SyntheticData(name, 2, 6, seed=0).examples("train", 0, 32)
    assert pairs and all(source and target for source, target in pairs)
    targets[name] = tuple(target for _, target in pairs)
  assert len(set(targets.values())) == len(SYNTHETIC_TASKS)
