"""Render a trained model's attention weights for one input as PNG heatmaps.

  python -m transformer_jax.attention_maps --workdir W --text "Ein Hund rennt im Schnee." \
      --output_dir maps [--attention all] [--layer -1] [--head -1] [--beam_size 4]

For each attention kind (`encoder` self-attention, `decoder` self-attention, `cross`
attention; encoder-only models have `encoder` only) it writes `KIND_layerL.png`: a grid of
all heads of layer L (or the one head `--head`), queries down, keys across, each axis
labelled with its tokens. A translation model first translates the text (beam search, as
`predict`), then attends over its own output. The model is the one `predict` would load.
"""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

import jax
import numpy as np
from absl import flags, logging

from transformer_jax import errors
from transformer_jax.errors import UserError
from transformer_jax.predict import Predictor

KINDS = ("encoder", "decoder", "cross")


def collect_weights(intermediates: Any) -> dict[str, list[np.ndarray]]:
  """{kind: [per-layer (heads, queries, keys) weights of the first example]} from the
  'intermediates' that the einsum attention sows (unrolled `layer_i` or scanned `layers`)."""
  found: dict[str, dict[int, np.ndarray]] = {k: {} for k in KINDS}
  for path, value in jax.tree_util.tree_flatten_with_path(intermediates)[0]:
    names = [str(getattr(p, "key", "")) for p in path]
    if "attention_weights" not in names:
      continue
    stack = "encoder" if "encoder" in names else "decoder"
    kind = "cross" if "cross_attention" in names else stack
    value = np.asarray(value, np.float32)
    if "layers" in names:                     # scanned: leading layer axis
      for layer, weights in enumerate(value):
        found[kind][layer] = weights[0]
    else:
      layer = next(int(n[len("layer_"):]) for n in names if str(n).startswith("layer_"))
      found[kind][layer] = value[0]
  return {k: [v[i] for i in sorted(v)] for k, v in found.items() if v}


def attention_for(predictor: Predictor, text: str,
                  beam_size: int = 4) -> tuple[dict[str, list[np.ndarray]], dict[str, list[str]]]:
  """The weights per kind and layer, and the token labels: {"source": ..., "target": ...}.
  The model first predicts `text` (a translation model attends over its own output)."""
  task = predictor.task
  length = len(task.tokenizer.encode(text))
  if length == 0:
    raise UserError("the input text has no tokens")
  if length > task.model_config.max_len:
    raise UserError(f"the input has {length} tokens; the model's max_len is "
                    f"{task.model_config.max_len}")
  output = predictor.predict_lines([text], predictor.decode_options(beam_size=beam_size))[0]
  intermediates, labels = task.attention(predictor.params, text, output)
  return collect_weights(intermediates), labels


def render(weights: np.ndarray, queries: list[str], keys: list[str], title: str,
           path: str, head: int = -1) -> None:
  """One heatmap per head of `weights` (heads, queries, keys), or only `head`."""
  import matplotlib
  matplotlib.use("Agg")                       # files only, no display
  import matplotlib.pyplot as plt

  heads = range(weights.shape[0]) if head < 0 else [head]
  cols = min(4, len(heads))
  rows = math.ceil(len(heads) / cols)
  size = max(3.0, 0.3 * max(len(queries), len(keys)) + 1.5)
  fig, axes = plt.subplots(rows, cols, figsize=(size * cols, size * rows), squeeze=False)
  for ax in axes.flat[len(heads):]:
    ax.axis("off")
  for ax, h in zip(axes.flat, heads):
    ax.imshow(weights[h], cmap="viridis", vmin=0.0, vmax=1.0)
    ax.set_title(f"head {h}")
    ax.set_xticks(range(len(keys)), keys, rotation=90, fontsize=8)
    ax.set_yticks(range(len(queries)), queries, fontsize=8)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def write_maps(predictor: Predictor, text: str, output_dir: str, kinds: Sequence[str] = KINDS,
               layer: int = -1, head: int = -1, beam_size: int = 4) -> list[str]:
  """Writes the PNGs and returns their paths."""
  weights, labels = attention_for(predictor, text, beam_size)
  axes = {"encoder": ("source", "source"), "decoder": ("target", "target"),
          "cross": ("target", "source")}
  os.makedirs(output_dir, exist_ok=True)
  paths = []
  for name in kinds:
    if name not in weights:
      continue                                # e.g. no decoder in an encoder-only model
    layers = weights[name]
    if not -len(layers) <= layer < len(layers):
      raise UserError(f"--layer={layer}: the {name} stack has {len(layers)} layers")
    index = layer % len(layers)
    if not -1 <= head < layers[index].shape[0]:
      raise UserError(f"--head={head}: the model has {layers[index].shape[0]} heads "
                      "(-1 draws all)")
    queries, keys = (labels[a] for a in axes[name])
    path = os.path.join(output_dir, f"{name}_layer{index}.png")
    render(layers[index], queries, keys, f"{name} attention, layer {index}", path, head)
    paths.append(path)
  return paths


FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command-line flags, defined only when this module is the program (so that other
  commands can import it)."""
  flags.DEFINE_string("workdir", None, "Training workdir (its newest model).")
  flags.DEFINE_string("checkpoint", None, "An export or checkpoint directory.")
  flags.DEFINE_string("text", None, "The input: a sentence (tagging: words separated "
                      "by spaces).", required=True)
  flags.DEFINE_string("output_dir", "attention_maps", "Where the PNGs go.")
  flags.DEFINE_enum("attention", "all", ("all",) + KINDS, "Which attention to draw.")
  flags.DEFINE_integer("layer", -1, "Layer index (negative: from the top).")
  flags.DEFINE_integer("head", -1, "One head, or -1 for a grid of all heads.")
  flags.DEFINE_integer("beam_size", 4, "Beam size for the translation drawn.")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if FLAGS.workdir is None and FLAGS.checkpoint is None:
    raise UserError("give --workdir or --checkpoint")
  kinds = KINDS if FLAGS.attention == "all" else (FLAGS.attention,)
  predictor = Predictor(FLAGS.workdir, FLAGS.checkpoint)
  paths = write_maps(predictor, FLAGS.text, FLAGS.output_dir, kinds, FLAGS.layer,
                     FLAGS.head, FLAGS.beam_size)
  print("\n".join(paths))


if __name__ == "__main__":
  define_flags()
  errors.run(main)
