"""The requirements files agree: every JAX pin names the version requirements.txt pins."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_JAX_PIN = re.compile(r"^(jax(?:lib)?|jax\[[\w,]+\]|jax-cuda\d+-(?:plugin|pjrt))==([\w.]+)",
                      re.MULTILINE)


def _pins(name: str) -> dict[str, str]:
  with open(os.path.join(ROOT, name)) as f:
    return dict(_JAX_PIN.findall(f.read()))


def test_every_jax_pin_is_requirements_txts_version():
  version = _pins("requirements.txt")["jax"]
  assert _pins("requirements.txt")["jaxlib"] == version
  cuda = _pins("requirements-cuda.txt")
  assert cuda == {"jax[cuda12]": version}, cuda
  assert set(_pins("requirements-gpu.txt").values()) == {version}
  assert set(_pins("requirements-tpu.txt").values()) == {version}


def test_the_pin_reader_sees_a_mismatch():
  text = "jax==0.10.2\njax[cuda12]==0.11.0  # a comment\njax-cuda12-plugin==0.10.2\n"
  assert dict(_JAX_PIN.findall(text)) == {"jax": "0.10.2", "jax[cuda12]": "0.11.0",
                                          "jax-cuda12-plugin": "0.10.2"}
