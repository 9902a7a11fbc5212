"""The command line of `python -m transformer_jax.convert` (see the package doc)."""

from __future__ import annotations

from absl import flags, logging

from transformer_jax import errors
from transformer_jax.convert.formats import AUTO, FORMATS, run

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command-line flags, defined only when this module is the program (other commands
  define some of the same names)."""
  flags.DEFINE_enum("from", None, [AUTO, *FORMATS], "Import this format; hf: the Hugging "
                    "Face family config.json's model_type names.")
  flags.DEFINE_enum("to", None, [AUTO, *FORMATS], "Export to this format; hf: the family "
                    "the model was imported from (else the first that expresses it).")
  flags.DEFINE_string("input", None, "Import: a Hugging Face save_pretrained directory "
                      "(MarianMT, GPT-2, Llama, Mistral, Qwen2/3, Gemma 3; the causal LMs: or "
                      "a Hugging Face Hub model, e.g. gpt2), "
                      "or a torch state_dict file (.safetensors, or .pt with --allow_pickle).")
  flags.DEFINE_string("output", None, "Export: the directory (hf_marian, hf_gpt2, hf_llama) or "
                      "file (torch: .safetensors, else torch.save) to write.")
  flags.DEFINE_string("workdir", None, "Import: where to write the parameter snapshot "
                      "exports/<name>; export: whose newest model to convert.")
  flags.DEFINE_string("checkpoint", None, "Export this parameter snapshot or checkpoint "
                      "directory instead of the workdir's newest.")
  flags.DEFINE_string("name", None, "Import: the parameter snapshot's name under "
                      "W/exports/ (default: the format).")
  flags.DEFINE_string("like", None, "--from=torch: a parameter snapshot, checkpoint or workdir whose "
                      "config and tokenizer the state_dict goes with.")
  flags.DEFINE_bool("allow_pickle", False, "Read pickled torch files (pytorch_model.bin, "
                    ".pt) with torch.load(weights_only=True).")


def main(argv: list[str]) -> None:
  logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
  if len(argv) > 1:
    raise errors.UserError(f"unexpected arguments: {' '.join(argv[1:])}")
  print(run(from_=FLAGS["from"].value, to=FLAGS.to, input=FLAGS.input, output=FLAGS.output,
            workdir=FLAGS.workdir, checkpoint_path=FLAGS.checkpoint, name=FLAGS.name,
            like=FLAGS.like, allow_pickle=FLAGS.allow_pickle))


if __name__ == "__main__":
  define_flags()
  errors.run(main)
