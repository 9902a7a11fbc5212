"""SST-2 as chat conversations for supervised fine-tuning (configs/sft_chat.py): each
sentence of ../shared/data/sst2 becomes one JSONL line

  {"messages": [{"role": "system", "content": INSTRUCTION},
                {"role": "user", "content": SENTENCE},
                {"role": "assistant", "content": "positive" | "negative"}]}

  python -m benchmarks.sst2_chat --data=../shared/data/sst2 --out=workdirs/sst2_chat

Reads DATA/train.tsv.gz and DATA/dev.tsv.gz (header `sentence<TAB>label`, 0 negative,
1 positive) and writes OUT/train.jsonl and OUT/validation.jsonl (the run's eval split).
OUT must lie outside the repository, or under its workdirs/ (which git ignores): the data
stays out of the project.
"""

from __future__ import annotations

import json
import os

from absl import flags

from transformer_jax import errors
from transformer_jax.data import readers

LABELS = ("negative", "positive")
INSTRUCTION = ("Classify the sentiment of the movie review sentence: answer positive or "
               "negative.")
SPLITS = {"train": "train.tsv", "validation": "dev.tsv"}   # written: read
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command-line flags, defined only when this module is the program."""
  flags.DEFINE_string("data", "../shared/data/sst2", "Directory with train.tsv.gz and "
                      "dev.tsv.gz.")
  flags.DEFINE_string("out", None, "Directory to write train.jsonl and validation.jsonl to "
                      "(created if missing), outside the repository or under its workdirs/.",
                      required=True)


def conversation(sentence: str, label: int) -> dict:
  """One labelled sentence as a conversation whose reply is its label's name."""
  return {"messages": [{"role": "system", "content": INSTRUCTION},
                       {"role": "user", "content": sentence},
                       {"role": "assistant", "content": LABELS[label]}]}


def check_out(out: str) -> None:
  """Refuses a directory that git would track: inside the repository but not workdirs/."""
  path = os.path.realpath(out)
  inside = lambda root: os.path.commonpath([path, root]) == root   # noqa: E731
  if inside(ROOT) and not inside(os.path.join(ROOT, "workdirs")):
    raise errors.UserError(f"--out={out} is inside the repository; write the data outside "
                           "it or under workdirs/ (the data stays out of the project)")


def write_chat_jsonl(data: str, out: str) -> dict[str, int]:
  """Writes each split as chat JSONL into `out`; returns the conversations per file."""
  check_out(out)
  splits = {name: readers.read_tsv(readers.find_file(data, source), LABELS)
            for name, source in SPLITS.items()}
  try:
    os.makedirs(out, exist_ok=True)
  except OSError as e:
    raise errors.UserError(f"--out={out}: {e.strerror or e} (choose a directory you can "
                           "write)") from None
  written = {}
  for name, records in splits.items():
    path = os.path.join(out, f"{name}.jsonl")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
      for record in records:
        f.write(json.dumps(conversation(record["text"], record["label"]),
                           ensure_ascii=False) + "\n")
    os.replace(path + ".tmp", path)
    written[path] = len(records)
  return written


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise errors.UserError(f"unexpected arguments {argv[1:]}; give --data and --out")
  for path, count in write_chat_jsonl(FLAGS.data, FLAGS.out).items():
    print(f"wrote {count:,} conversations to {path}")


if __name__ == "__main__":
  define_flags()
  errors.run(main)
