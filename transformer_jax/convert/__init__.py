"""Checkpoints in and out: Hugging Face MarianMT (OPUS-MT), GPT-2, and the causal LMs of
Llama's shape (Llama 3.x, Mistral, Qwen2/2.5, Qwen3, Gemma 3), torch.nn.Transformer.

  python -m transformer_jax.convert --from=hf --input=DIR|HUB_NAME --workdir=W
  python -m transformer_jax.convert --to=hf --workdir=W --output=DIR

  python -m transformer_jax.convert --from=hf_marian --input=DIR --workdir=W [--allow_pickle]
  python -m transformer_jax.convert --to=hf_marian --workdir=W --output=DIR
  python -m transformer_jax.convert --from=hf_gpt2 --input=DIR|HUB_NAME --workdir=W
  python -m transformer_jax.convert --to=hf_gpt2 --workdir=W --output=DIR
  python -m transformer_jax.convert --from=hf_llama --input=DIR|HUB_NAME --workdir=W
  python -m transformer_jax.convert --to=hf_llama --workdir=W --output=DIR
  python -m transformer_jax.convert --to=torch --workdir=W --output=FILE
  python -m transformer_jax.convert --from=torch --input=FILE --like=MODEL --workdir=W

`--from=hf` picks the row by config.json's model_type (formats.MODEL_TYPES); `--to=hf`
writes the family the model came from. An import writes a parameter snapshot,
W/exports/<name>/, in the format of
`python -m transformer_jax.export` (params, run config, tokenizers, manifest), which
`predict`, `attention_maps`, `--eval_only` and `init_from` read. An export to hf_marian
writes a `save_pretrained` directory that `MarianMTModel` and `MarianTokenizer` load (to
hf_gpt2: `GPT2LMHeadModel` and `GPT2Tokenizer`; to hf_llama: `LlamaForCausalLM` and
`AutoTokenizer`); to torch, a state_dict file.

MarianMT is the paper's post-LN Transformer with shared, tied embeddings. What differs is
expressed by config fields: sinusoidal_layout="halves" (sin in the first half),
activation="swish", final_logits_bias=True, layer_norm_epsilon=1e-5 (torch's default), and
the special ids (see `marian`). GPT-2 and Llama are our LanguageModel with options (see
`gpt2`, `llama`).

  tensors            our parameter names and shapes; ConvertError
  marian             MarianMT's config, ids and tensor names (pure tables)
  torch_transformer  torch.nn.Transformer's tensor names (pure tables)
  files              file reading and writing shared by the formats; our models in and out
  hf                 what the Hugging Face formats share: activations, weights, JSON, the Hub
  hf_lm              what the Hugging Face language models share: ids, import, export
  marian_files       the MarianMT save_pretrained directory in and out
  gpt2               GPT-2's config and tensor names, its directory in and out
  llama              Llama's config and tensor names, its directory in and out; `Shape`,
                     `family`: the Llama-shaped families built on it
  mistral, qwen,     Mistral, Qwen2 and Qwen3, Gemma 3: each a `Shape` (what it changes)
  gemma3
  formats            the table of formats and `run`
  __main__           the command line
"""

from transformer_jax.convert.files import OurModel, load_ours, read_state_dict, save_params_snapshot
from transformer_jax.convert.formats import FORMATS, run
from transformer_jax.convert.gpt2 import import_gpt2, write_hf_gpt2
from transformer_jax.convert.llama import import_llama, write_hf_llama
from transformer_jax.convert.marian_files import import_marian, write_hf_marian
from transformer_jax.convert.tensors import ConvertError, abstract_params, permute_embed_axes
from transformer_jax.convert.torch_transformer import params_from_torch_state_dict, torch_state_dict

__all__ = ["ConvertError", "FORMATS", "OurModel", "abstract_params", "import_gpt2",
           "import_llama", "import_marian", "load_ours", "params_from_torch_state_dict", "permute_embed_axes",
           "read_state_dict", "run", "save_params_snapshot", "torch_state_dict",
           "write_hf_gpt2", "write_hf_llama", "write_hf_marian"]
