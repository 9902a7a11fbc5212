"""LoRA (transformer_jax/lora.py): adapters as a pure function of the parameters. A LoRA
model at step 0 is its base exactly; training moves the adapters only, on any mesh; a run
stopped and resumed ends where the straight run ends, bit for bit; whatever reads the
workdir (predict, export) gets the merged, plain model; bad options end in one line naming
the field. A tiny Llama-shaped character LM (gated SiLU feed-forward, 2 key/value heads)."""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from transformer_jax import TransformerConfig, checkpoint, lora, trees
from transformer_jax.errors import UserError
from transformer_jax.options import LORA_TARGETS, LoraOptions
from transformer_jax.tasks.lm import LanguageModelTask

LLAMA = dict(positional="rotary", norm_type="rms", gated_ffn=True, activation="silu",
             num_kv_heads=2, use_bias=False, norm_position="pre")
RANK = 4


def _cfg(**overrides) -> TransformerConfig:
  fields = dict(vocab_size=30, d_model=16, num_heads=4, d_ff=24, num_encoder_layers=0,
                num_decoder_layers=2, dropout_rate=0.0, max_len=16, attention_impl="einsum",
                **LLAMA)
  return TransformerConfig(**{**fields, **overrides})


@functools.lru_cache(maxsize=None)
def _base(cfg: TransformerConfig) -> tuple[LanguageModelTask, dict]:
  """The task and its (unboxed, host) initial parameters."""
  task = LanguageModelTask(cfg, label_smoothing=0.0)
  return task, jax.device_get(nn.meta.unbox(jax.jit(task.init_params)(jax.random.key(0))))


def _shapes(cfg: TransformerConfig) -> dict:
  """The parameters' shapes (nothing compiled)."""
  task = LanguageModelTask(cfg, label_smoothing=0.0)
  return nn.meta.unbox(jax.eval_shape(task.init_params, jax.random.key(0)))


def _batch(rows: int = 2, length: int = 8) -> dict[str, np.ndarray]:
  tokens = np.random.default_rng(0).integers(4, 30, (rows, length + 1)).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
          "positions": np.tile(np.arange(length, dtype=np.int32), (rows, 1)),
          "segment_ids": np.ones((rows, length), np.int32)}


# ------------------------------------------------------------------------------ options
@pytest.mark.parametrize("given, message", [
    (dict(rank=-1), "lora.rank=-1: must be an integer >= 0"),
    (dict(rank=1.5), "lora.rank=1.5: must be an integer >= 0"),
    (dict(alpha=0), "lora.alpha=0: must be a number > 0"),
    (dict(dropout=-0.1), "lora.dropout=-0.1: must be in"),
    (dict(dropout=1.0), "lora.dropout=1.0: must be in"),
    (dict(targets=()), "lora.targets=(): must be a non-empty subset"),
    (dict(targets=("q_proj", "qkv")), "lora.targets=('q_proj', 'qkv'): must be a non-empty"),
])
def test_bad_options_are_one_line_naming_the_field(given, message):
  with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
    LoraOptions(**given)
  assert "\n" not in str(e.value)


def test_options_defaults_and_targets_from_the_command_line():
  assert LoraOptions() == LoraOptions(rank=0, alpha=16.0, dropout=0.0, targets=LORA_TARGETS)
  # ml_collections reads --config.lora.targets=q_proj,v_proj as ("q_proj,v_proj",).
  for given in ("q_proj,v_proj", ("q_proj,v_proj",), ["q_proj", " v_proj"]):
    assert LoraOptions(rank=2, targets=given).targets == ("q_proj", "v_proj")


def test_lora_needs_init_from_and_a_model_of_the_run_s_task(tmp_path):
  from configs import default
  from transformer_jax.training.experiment import Experiment
  config = default.get_config()
  config.lora.rank = 4
  with pytest.raises(UserError, match=r"^lora.rank=4 adapts a pretrained model: set "
                                      r"config.init_from"):
    Experiment.create(config, str(tmp_path), data=False, vocab_sizes=(20, None))


def test_fused_qkv_and_missing_targets_are_refused():
  fused = dict(fused_qkv=True)
  with pytest.raises(UserError, match=r"model.fused_qkv=True.*leave them out of lora.targets"):
    lora.check(LoraOptions(rank=2), fused)
  lora.check(LoraOptions(rank=2, targets=("o_proj", "down_proj")), fused)
  with pytest.raises(UserError, match="no gate_proj; target up_proj"):
    lora.check(LoraOptions(rank=2, targets=("gate_proj",)), dict(gated_ffn=False))
  with pytest.raises(UserError, match=r"lora.targets=\('gate_proj',\) match no kernel"):
    lora.init_adapters(_shapes(_cfg(gated_ffn=False)), LoraOptions(rank=2, targets=("gate_proj",)),
                       jax.random.key(0))


# ---------------------------------------------------------------------- the function
@pytest.mark.parametrize("scan", [False, True])
def test_adapters_have_the_kernels_in_and_out_shapes(scan):
  """a: in_shape + (r,), b: (r,) + out_shape, per Llama target; scanned layers keep their
  leading layer axis; a plain feed-forward's wi is up_proj."""
  adapters = lora.init_adapters(_shapes(_cfg(scan_layers=scan)), LoraOptions(rank=RANK),
                                jax.random.key(1))
  shapes = {p: tuple(x.shape) for p, x in trees.named_leaves(adapters)}
  layer = (2,) if scan else ()
  prefix = "decoder/layers" if scan else "decoder/layer_0"
  expected = {"self_attention/query": ((16,), (4, 4)), "self_attention/key": ((16,), (2, 4)),
              "self_attention/value": ((16,), (2, 4)), "self_attention/out": ((4, 4), (16,)),
              "feed_forward/wi": ((16,), (24,)), "feed_forward/wi_up": ((16,), (24,)),
              "feed_forward/wo": ((24,), (16,))}
  for name, (ins, outs) in expected.items():
    assert shapes[f"{prefix}/{name}/kernel/a"] == layer + ins + (RANK,)
    assert shapes[f"{prefix}/{name}/kernel/b"] == layer + (RANK,) + outs
  assert len(shapes) == 2 * len(expected) * (1 if scan else 2)
  assert all(not np.any(x) for p, x in trees.named_leaves(adapters) if p.endswith("/b"))
  ups = lora.targets(_shapes(_cfg(gated_ffn=False)), LoraOptions(rank=2, targets=("up_proj",)))
  assert sorted(ups) == [f"decoder/layer_{i}/feed_forward/wi/kernel" for i in (0, 1)]


@pytest.mark.parametrize("scan", [False, True])
def test_step_0_is_the_base_exactly(scan):
  """B = 0: the merged parameters are the base's bit for bit, and so are the logits."""
  task, params = _base(_cfg(scan_layers=scan))
  options = LoraOptions(rank=RANK)
  adapters = lora.init_adapters(params, options, jax.random.key(1))
  merged = lora.merge(params, adapters, options)
  for (_, m), (_, p) in zip(trees.named_leaves(merged), trees.named_leaves(params)):
    assert np.asarray(m).tobytes() == np.asarray(p).tobytes()
  logits = jax.jit(lambda p: task.logits(p, _batch(), None, False))
  assert np.array_equal(logits(merged), logits(params))


def test_merge_is_w_plus_alpha_over_rank_a_b_and_freezes_the_base():
  _, params = _base(_cfg(scan_layers=True))
  options = LoraOptions(rank=RANK, alpha=8.0, targets=("q_proj", "o_proj"))
  adapters = lora.init_adapters(params, options, jax.random.key(1))
  rng = np.random.default_rng(0)
  adapters = jax.tree_util.tree_map(lambda x: rng.normal(size=x.shape).astype(np.float32),
                                    adapters)
  merged = lora.merge(params, adapters, options)
  for name in ("query", "out"):
    path = f"decoder/layers/self_attention/{name}/kernel"
    w, a, b = (np.asarray(trees.get_path(t, p)) for t, p in (
        (params, path), (adapters, path + "/a"), (adapters, path + "/b")))
    flat_a = a.reshape(2, -1, RANK)
    delta = np.einsum("lir,lro->lio", flat_a, b.reshape(2, RANK, -1)).reshape(w.shape)
    np.testing.assert_allclose(trees.get_path(merged, path), w + 2.0 * delta, rtol=1e-5,
                               atol=1e-5)
  assert np.array_equal(merged["decoder"]["layers"]["self_attention"]["key"]["kernel"],
                        params["decoder"]["layers"]["self_attention"]["key"]["kernel"])
  # The base gets no gradient through merge, the adapters do.
  loss = lambda p, ad: sum(jnp.sum(x ** 2) for x in jax.tree_util.tree_leaves(
      lora.merge(p, ad, options)))
  base_grad, adapter_grad = jax.grad(loss, argnums=(0, 1))(params, adapters)
  assert not any(np.any(g) for g in jax.tree_util.tree_leaves(base_grad))
  assert all(np.any(g) for g in jax.tree_util.tree_leaves(adapter_grad))
  with pytest.raises(ValueError, match="do not fit the kernel"):
    lora.merge(params, jax.tree_util.tree_map(lambda x: x[..., :1, :], adapters), options)


def _random_adapters(params: dict, options: LoraOptions) -> dict:
  rng = np.random.default_rng(0)
  return jax.tree_util.tree_map(lambda x: 0.3 * rng.normal(size=x.shape).astype(np.float32),
                                lora.init_adapters(params, options, jax.random.key(1)))


@pytest.mark.parametrize("scan", [False, True])
def test_adapters_on_the_activations_equal_the_merged_kernels(scan):
  """Training's x W + s (x A) B (per layer, also inside nn.scan) gives the merged model's
  loss and the same adapter gradients; the base gets none."""
  task, params = _base(_cfg(scan_layers=scan))
  options = LoraOptions(rank=RANK, alpha=8.0)
  adapters = _random_adapters(params, options)
  batch, key = _batch(), jax.random.key(2)

  def on_activations(base, ad):
    with lora.applying(options):
      return task.loss_sums(lora.model_params(lora.adapted(base, ad), options), batch, key,
                            True)["loss"]

  merged = lambda base, ad: task.loss_sums(lora.merge(base, ad, options), batch, key,
                                           True)["loss"]
  (loss, (base_grad, grads)) = jax.value_and_grad(on_activations, (0, 1))(params, adapters)
  (expected, (_, expected_grads)) = jax.value_and_grad(merged, (0, 1))(params, adapters)
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  assert float(loss) != float(task.loss_sums(params, batch, key, True)["loss"])
  for (path, g), (_, e) in zip(trees.named_leaves(grads), trees.named_leaves(expected_grads)):
    np.testing.assert_allclose(g, e, rtol=1e-3, atol=2e-5, err_msg=path)
  assert not any(np.any(g) for g in jax.tree_util.tree_leaves(base_grad))


def test_adapter_dropout_drops_the_adapters_input_in_training_only():
  """With lora.dropout the adapters see a dropped input when the model is given a dropout
  key (training) and the whole input otherwise; the base's path is never dropped, so B = 0
  is the base exactly even in training."""
  task, params = _base(_cfg())
  options = LoraOptions(rank=RANK, dropout=0.5)
  batch, key = _batch(), jax.random.key(2)

  def logits(ad, opts, train):
    with lora.applying(opts):
      return task.logits(lora.model_params(lora.adapted(params, ad), opts), batch, key, train)

  zero_b = lora.init_adapters(params, options, jax.random.key(1))
  assert np.array_equal(logits(zero_b, options, True), task.logits(params, batch, key, True))
  adapters = _random_adapters(params, options)
  kept = dataclasses.replace(options, dropout=0.0)
  assert np.array_equal(logits(adapters, options, False), logits(adapters, kept, False))
  assert not np.allclose(logits(adapters, options, True), logits(adapters, kept, True))


# ------------------------------------------------------------------------ training
def _text(data) -> None:
  words = "the king and the queen spoke of the crown and the sword\n".split(" ")
  rng = np.random.default_rng(0)
  for split, count in (("train", 3000), ("val", 200)):
    with gzip.open(data / f"{split}.txt.gz", "wt") as f:
      f.write(" ".join(rng.choice(words, count)))


def _config(data_dir: str, steps: int, init_from: str = "", rank: int = 0):
  from configs import shakespeare_char
  config = shakespeare_char.get_config()
  config.data.dir = data_dir
  config.update(dict(num_train_steps=steps, eval_every_steps=100, checkpoint_every_steps=3,
                     log_every_steps=1, batch_size=8, init_from=init_from))
  config.data.max_length = config.data.eval_max_length = 16
  config.decode.max_new_tokens = 4
  config.eval.num_samples = 0
  config.model.update(dict(d_model=16, num_heads=4, d_ff=24, num_decoder_layers=1,
                           max_len=16, attention_impl="xla", **LLAMA))
  # AdamW: every trained leaf then holds two moments, which the tests below count.
  config.optimizer.update(dict(name="adamw", learning_rate=3e-2, end_learning_rate=3e-3,
                               warmup_steps=1))
  config.lora.update(dict(rank=rank, alpha=8.0))
  return config


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
  """The text, and the model LoRA adapts: a parameter snapshot of a tiny LM, as an import
  writes one (its run config, its tokenizer)."""
  from transformer_jax.data.tokenizer import tokenizer_item
  from transformer_jax.training.experiment import Experiment
  data = tmp_path_factory.mktemp("text")
  _text(data)
  experiment = Experiment.create(_config(str(data), 2), str(tmp_path_factory.mktemp("base")))
  params = jax.device_get(nn.meta.unbox(experiment.task.init_params(jax.random.key(0))))
  path = checkpoint.write_snapshot(
      str(tmp_path_factory.mktemp("import") / "snapshot"), params,
      experiment.resolved_config(), tokenizer_item(experiment.data.tokenizer, None), [0])
  return dict(data=str(data), path=path)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, base) -> str:
  """A LoRA run of 6 steps straight through."""
  from transformer_jax.training import loop
  workdir = str(tmp_path_factory.mktemp("lora") / "straight")
  loop.train_and_evaluate(_config(base["data"], 6, base["path"], RANK), workdir)
  return workdir


def _saved(workdir: str, step: int) -> dict:
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
    return dict(checkpointer.restore(
        os.path.abspath(os.path.join(workdir, "checkpoints", str(step))),
        args=ocp.args.Composite(params=ocp.args.StandardRestore(),
                                train=ocp.args.StandardRestore(), config=ocp.args.JsonRestore())))


def _merged_by_hand(base: dict, workdir: str, step: int) -> dict:
  saved = _saved(workdir, step)
  return jax.device_get(lora.merge(checkpoint.restore_params(base["path"]), saved["params"],
                                   LoraOptions.from_dict(saved["config"]["lora"])))


def test_only_the_adapters_train_and_the_checkpoint_holds_only_them(base, tmp_path):
  """The step moves the adapters (B leaves zero) and the loss falls, while the base stays
  bit for bit the import's; the optimizer keeps state for the adapters only. On a mesh with
  fsdp and tensor axes (the base split, the adapters replicated), and with ZeRO-1 and the
  gradients summed by hand (mesh.reduce_gradients_in); data=8 alone: the runs below."""
  from transformer_jax.training.experiment import Experiment
  pretrained = jax.device_get(checkpoint.restore_params(base["path"]))
  first_losses = []
  for mesh in (dict(data=2, fsdp=2, tensor=2),
               dict(data=-1, shard_optimizer_state=True, reduce_gradients_in="float32")):
    config = _config(base["data"], 6, base["path"], RANK)
    config.mesh.update(mesh)
    experiment = Experiment.create(config, str(tmp_path / str(len(first_losses))))
    state, state_sharding = experiment.init_state()
    state = state.replace(params=experiment.initial_params(state.params)[0])
    adapters = lora.trainable(state.params)
    assert all(axis is None for s in jax.tree_util.tree_leaves(state_sharding.params[
        "adapters"]) for axis in s.spec)                      # replicated
    if "tensor" in mesh:
      kernel = state_sharding.params["base"]["decoder"]["layer_0"]["feed_forward"]["wi"]
      assert "tensor" in jax.tree_util.tree_leaves(tuple(kernel["kernel"].spec))
    moments = [x.size for x in jax.tree_util.tree_leaves(state.opt_state) if x.ndim]
    assert sum(moments) == 2 * sum(x.size for x in jax.tree_util.tree_leaves(adapters))
    step = experiment.train_step(state_sharding)
    batch = next(experiment.data.train_iterator(experiment.task, 8))
    losses = []
    for _ in range(5):
      state, metrics = step(state, jax.tree_util.tree_map(
          lambda x: jax.device_put(x, jax.sharding.NamedSharding(
              experiment.mesh, jax.sharding.PartitionSpec(("data", "fsdp")))), batch))
      losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    first_losses.append(losses[0])
    for (path, now), (_, then) in zip(trees.named_leaves(state.params["base"]),
                                      trees.named_leaves(pretrained)):
      assert np.asarray(now).tobytes() == np.asarray(then).tobytes(), path
    assert all(np.any(b) for p, b in trees.named_leaves(lora.trainable(state.params))
               if p.endswith("/b"))
  assert first_losses[1] == pytest.approx(first_losses[0], rel=1e-5)


class _StopAfter3:
  """A preemption notice at step 3, as SIGTERM gives one."""
  signal_name = "SIGTERM"

  def start(self) -> None: ...
  def stop(self) -> None: ...

  def should_stop(self, step: int) -> bool:
    return step == 3


def test_stopped_and_resumed_run_equals_the_straight_run(base, straight, tmp_path,
                                                         monkeypatch):
  """The same command twice, stopped after step 3: the adapters, their optimizer state,
  step and RNG at step 6 equal the straight run's bit for bit, and so do the losses. The
  checkpoint holds the adapters and names the base."""
  from transformer_jax.training import loop
  workdir = str(tmp_path / "resumed")
  with monkeypatch.context() as patch:
    patch.setattr(loop, "PreemptionWatcher", _StopAfter3)
    loop.train_and_evaluate(_config(base["data"], 6, base["path"], RANK), workdir)
  assert checkpoint.checkpoint_steps(os.path.join(workdir, "checkpoints")) == [3]
  loop.train_and_evaluate(_config(base["data"], 6, base["path"], RANK), workdir)
  ours, theirs = _saved(workdir, 6), _saved(straight, 6)
  for item in ("params", "train"):
    a, b = (jax.tree_util.tree_leaves_with_path(x[item]) for x in (ours, theirs))
    assert [p for p, _ in a] == [p for p, _ in b]
    for (path, x), (_, y) in zip(a, b):
      assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), path
  names = [p for p, _ in trees.named_leaves(ours["params"])]
  assert names and all(p.endswith(("/kernel/a", "/kernel/b")) for p in names)
  assert ours["config"]["init_from"] == os.path.abspath(base["path"])

  def losses(w):
    with open(os.path.join(w, "metrics.jsonl")) as f:
      return {r["step"]: r["train/loss"] for r in map(json.loads, f) if "train/loss" in r}
  assert losses(workdir) == losses(straight) and len(losses(straight)) == 6


def test_predict_and_export_load_the_merged_model(base, straight, tmp_path):
  """predict on the LoRA workdir loads the base merged with the adapters (bit for bit what
  merging them by hand gives) and continues prompts as that plain model does; the export
  is a plain parameter snapshot of it (LoRA off in its config)."""
  from transformer_jax.predict import Predictor
  merged = _merged_by_hand(base, straight, 6)
  ours = Predictor(straight)
  for (path, x), (_, y) in zip(trees.named_leaves(ours.params), trees.named_leaves(merged)):
    assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), path
  assert not np.array_equal(ours.params["decoder"]["layer_0"]["self_attention"]["query"]
                            ["kernel"], jax.device_get(checkpoint.restore_params(base["path"]))
                            ["decoder"]["layer_0"]["self_attention"]["query"]["kernel"])
  export = checkpoint.write_average(os.path.join(straight, "checkpoints"), [6],
                                    str(tmp_path / "export"))
  assert checkpoint.read_record(export).config["lora"]["rank"] == 0
  plain = Predictor(checkpoint_path=export)
  for (path, x), (_, y) in zip(trees.named_leaves(plain.params), trees.named_leaves(merged)):
    assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), path
  greedy = ours.decode_options(temperature=0.0, max_new_tokens=5)
  prompts = ["the king", "queen and", ""]
  assert ours.predict_lines(prompts, greedy) == plain.predict_lines(prompts, greedy)
  # Adapters whose model has gone: one line naming it, not a damaged checkpoint.
  saved, gone = _saved(straight, 6), str(tmp_path / "moved")
  orphan = checkpoint.write_snapshot(str(tmp_path / "orphan"), jax.device_get(saved["params"]),
                                     {**saved["config"], "init_from": gone}, {}, [6])
  with pytest.raises(checkpoint.IncompatibleCheckpointError,
                     match=f"holds LoRA adapters of the model at init_from='{gone}', which is "
                           "gone; put it back there"):
    Predictor(checkpoint_path=orphan)
