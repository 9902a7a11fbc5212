"""Device mesh, logical-axis rules and shardings: how one jitted program runs on 1 or N devices.

Parameters carry logical axis names (`embed`, `heads`, `mlp`, `vocab`, ...; see modules/).
`LOGICAL_AXIS_RULES` maps them onto a 3-axis mesh:
  data    batch only (pure data parallelism: parameters replicated);
  fsdp    batch, and parameters/optimizer state split along `embed` (ZeRO-3 style);
  tensor  attention heads, FFN hidden units and the vocabulary (Megatron-style).
`jax.jit` with these shardings is what pjit became; XLA's partitioner inserts the
collectives, so the model code does not change with the layout.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Callable, Iterator, Sequence

import flax.linen as nn
import jax
import numpy as np
from absl import logging
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from transformer_jax.errors import UserError

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# (logical name, mesh axes); names not listed are replicated.
LOGICAL_AXIS_RULES = (
    ("batch", BATCH_AXES),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
)


# The batch sharding that the model keeps its layers' outputs in while a step is traced
# (`activations_split_over_batch`); None: no constraint.
_ACTIVATION_ROWS: contextvars.ContextVar[NamedSharding | None] = contextvars.ContextVar(
    "activation_rows", default=None)
# The mesh a step's arrays are split over while it is traced, for the kernels that must run
# per device (shard_map: a Pallas kernel cannot be partitioned automatically); None: the
# arrays are whole, or already one device's (inside a shard_map).
_STEP_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("step_mesh",
                                                                         default=None)


@contextlib.contextmanager
def activations_split_over_batch(rows: NamedSharding | None) -> Iterator[None]:
  """While a step is traced under it, `constrain_to_batch` keeps each layer's output split
  over the batch axes and whole along d_model. Only where fsdp > 1: the parameters are then
  split along d_model (`embed`) too, and left to itself the partitioner may move the
  activations to match them instead of gathering the weights (XLA's TPU plan for big with
  data=1, fsdp=4 all-gathered 19x the bf16 parameters a step; benchmarks/RESULTS.md).
  Elsewhere propagation already keeps the batch split, and the program is left as it is.
  `rows`: the batch's sharding, as the steps take it (None: one device, no constraint)."""
  on_mesh = rows is not None and isinstance(rows.mesh, Mesh) and rows.mesh.shape["fsdp"] > 1
  token = _ACTIVATION_ROWS.set(rows if on_mesh else None)
  mesh = rows.mesh if rows is not None and isinstance(rows.mesh, Mesh) else None
  mesh_token = _STEP_MESH.set(mesh if mesh is not None and mesh.size > 1 else None)
  try:
    yield
  finally:
    _ACTIVATION_ROWS.reset(token)
    _STEP_MESH.reset(mesh_token)


@contextlib.contextmanager
def per_device() -> Iterator[None]:
  """Inside a shard_map over the step's mesh: arrays are one device's, so `step_mesh` is
  None and the kernels run as they are."""
  token = _STEP_MESH.set(None)
  try:
    yield
  finally:
    _STEP_MESH.reset(token)


def step_mesh() -> Mesh | None:
  """The mesh of the step being traced when its arrays are split over several devices."""
  return _STEP_MESH.get()


def constrain_to_batch(x: jax.Array) -> jax.Array:
  """`x` (batch, ...) split over the batch axes, whole along the rest, inside
  `activations_split_over_batch`; unchanged outside it."""
  return split_over_batch(x, _ACTIVATION_ROWS.get())


def split_over_batch(x: jax.Array, rows: NamedSharding | None) -> jax.Array:
  """`x` (batch, ...) constrained to `rows` (a `batch_sharding`) where its rows divide
  evenly over the batch axes; unchanged otherwise or where `rows` is None."""
  if rows is None or x.shape[0] % batch_ways(rows.mesh):
    return x
  return jax.lax.with_sharding_constraint(x, rows)


class MeshError(UserError):
  """A mesh that does not fit the devices, or a batch that does not fit the mesh."""


def partitioned(init: Callable[..., Any], names: tuple[str | None, ...]) -> Callable[..., jax.Array]:
  """`init` with the logical axis names of its parameter, which the rules above map to mesh
  axes (`self.param` unboxes the parameter to an array)."""
  return nn.with_logical_partitioning(init, names)  # type: ignore[return-value]


def resolve_mesh_shape(sizes: dict[str, int], num_devices: int,
                       platform: str | None = None) -> tuple[int, ...]:
  """Sizes per MESH_AXES with at most one -1 ("the remaining devices"); their product must
  be the device count. `platform` names the devices in errors (default: JAX's backend)."""
  unknown = [k for k in sizes if k not in MESH_AXES]
  if unknown:
    raise MeshError(f"unknown mesh axes {unknown}; the mesh axes are {MESH_AXES}")
  shape = [sizes.get(axis, 1) for axis in MESH_AXES]
  for axis, size in zip(MESH_AXES, shape):
    if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
      raise MeshError(f"mesh.{axis}={size!r}: must be a positive integer or -1")
  if shape.count(-1) > 1:
    raise MeshError(f"mesh {dict(zip(MESH_AXES, shape))}: at most one axis may be -1")
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if num_devices % known:
      raise MeshError(f"mesh {dict(zip(MESH_AXES, shape))}: the fixed axes ({known} devices) "
                      f"do not divide the {num_devices} available devices")
    shape[shape.index(-1)] = num_devices // known
  if math.prod(shape) != num_devices:
    raise MeshError(f"mesh {dict(zip(MESH_AXES, shape))} needs {math.prod(shape)} devices but "
                    f"{num_devices} are available ({platform or jax.default_backend()}); make the product "
                    "of data*fsdp*tensor equal the device count, or set one axis to -1")
  return tuple(shape)


def make_mesh(sizes: dict[str, int], devices: Sequence[Any] | None = None) -> Mesh:
  """A (data, fsdp, tensor) mesh over `devices` (default: all devices of all processes;
  `aot` passes the compile-only devices of a TPU topology)."""
  devices = jax.devices() if devices is None else list(devices)
  shape = resolve_mesh_shape(dict(sizes), len(devices), devices[0].device_kind)
  # Auto axes: shardings are given at jit boundaries and XLA propagates them inside.
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                       devices=devices)


def _fit_spec(spec: P, shape: tuple[int, ...], mesh: Mesh, name: str,
              unfit: list[str]) -> P:
  """Replicates any dimension whose size the mesh axes assigned to it do not divide (e.g. 2
  heads on tensor=4): XLA needs even shards."""
  dims = []
  for size, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    ways = math.prod(mesh.shape[a] for a in names)
    if ways > 1 and size % ways:
      unfit.append(f"{name} dim of size {size} over {names}")
      axes = None
    dims.append(axes)
  return P(*dims)


def shardings_for(boxed_tree: Any, mesh: Mesh,
                  rules: tuple = LOGICAL_AXIS_RULES) -> Any:
  """NamedShardings for a pytree whose leaves are logically partitioned boxes (as from
  `jax.eval_shape` of an init that keeps Flax's boxes) or plain arrays (replicated)."""
  def logical_spec(x: Any) -> Any:
    if isinstance(x, nn.meta.AxisMetadata) and not jax.tree_util.tree_leaves(x.unbox()):
      return x.unbox()    # a box around no array: a masked optimizer state's (Muon's) there
    return nn.get_partition_spec(x)
  logical = jax.tree_util.tree_map(logical_spec, boxed_tree,
                                   is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
  mesh_specs = nn.logical_to_mesh(logical, rules)
  shapes = nn.meta.unbox(boxed_tree)
  unfit: list[str] = []
  paths_specs, treedef = jax.tree_util.tree_flatten_with_path(
      mesh_specs, is_leaf=lambda x: isinstance(x, P))
  fitted = [
      _fit_spec(spec, leaf.shape, mesh, jax.tree_util.keystr(path), unfit)
      for (path, spec), leaf in zip(paths_specs, jax.tree_util.tree_leaves(shapes))]
  if unfit:
    logging.warning("not sharded (size not divisible by the mesh axes), replicated instead: %s",
                    "; ".join(unfit[:8]) + (f"; ... {len(unfit) - 8} more" if len(unfit) > 8
                                            else ""))
  return jax.tree_util.tree_unflatten(treedef, [NamedSharding(mesh, s) for s in fitted])


def split_over_data(shardings: Any, shapes: Any) -> Any:
  """Each array's sharding, further split over the data axis on its first dimension that
  the data ways (times the axes already on it) divide; an array without one (a scalar, a
  bias too small) keeps its sharding. For the optimizer state, with the parameters left
  replicated over data, it is ZeRO-1: each data replica updates only its share of the
  moments, then all-gathers the updated parameters (how the gradients are reduced:
  training/steps.py)."""
  def split(named: NamedSharding, shape: Any) -> NamedSharding:
    data = named.mesh.shape["data"]
    spec = tuple(named.spec) + (None,) * (len(shape.shape) - len(named.spec))
    if data == 1 or any("data" in _axis_names(axes) for axes in spec):
      return named
    for i, (size, axes) in enumerate(zip(shape.shape, spec)):
      names = _axis_names(axes)
      if size % (data * math.prod(named.mesh.shape[a] for a in names)) == 0:
        return NamedSharding(named.mesh, P(*spec[:i], ("data", *names), *spec[i + 1:]))
    return named
  return jax.tree_util.tree_map(split, shardings, nn.meta.unbox(shapes))


def _axis_names(axes: Any) -> tuple[str, ...]:
  return (axes,) if isinstance(axes, str) else tuple(axes or ())


def abstract_sharded(init_fn: Callable[[], Any], mesh: Mesh,
                     rules: tuple = LOGICAL_AXIS_RULES,
                     shardings: Any = None) -> tuple[Any, Any]:
  """What `create_sharded` would create, without allocating: `jax.ShapeDtypeStruct`s carrying
  the shardings (for ahead-of-time compilation, see transformer_jax/aot), and the shardings
  (the rules', unless given)."""
  boxed = jax.eval_shape(init_fn)
  shardings = shardings_for(boxed, mesh, rules) if shardings is None else shardings
  shapes = jax.tree_util.tree_map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      nn.meta.unbox(boxed), shardings)
  return shapes, shardings


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) dimension split over data x fsdp, the rest replicated."""
  return NamedSharding(mesh, P(BATCH_AXES))


def batch_sharding_of(tree: Any) -> NamedSharding | None:
  """`batch_sharding` of the mesh that `tree`'s arrays live on; None off a mesh (host
  arrays, or arrays placed on one device)."""
  leaves = jax.tree_util.tree_leaves(tree)
  placed = getattr(leaves[0], "sharding", None) if leaves else None
  if isinstance(placed, NamedSharding) and isinstance(placed.mesh, Mesh):
    return batch_sharding(placed.mesh)
  return None


def replicated(mesh: Mesh | AbstractMesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_ways(mesh: Mesh | AbstractMesh) -> int:
  return mesh.shape["data"] * mesh.shape["fsdp"]


def check_batch_fits(global_batch_size: int, mesh: Mesh, what: str = "batch_size") -> None:
  if global_batch_size % batch_ways(mesh):
    raise MeshError(f"{what}={global_batch_size} is not divisible by mesh data*fsdp="
                    f"{batch_ways(mesh)}; every device needs an equal share of the batch")


def local_rows(global_batch_size: int) -> slice:
  """The rows of a global batch that this process feeds (hosts feed disjoint slices)."""
  per_process = global_batch_size // jax.process_count()
  start = jax.process_index() * per_process
  return slice(start, start + per_process)


def to_global(local_batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Global arrays, batch-sharded on the mesh, from this process's rows of the batch."""
  sharding = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
          for k, v in local_batch.items()}


def create_sharded(init_fn: Callable[[], Any], mesh: Mesh,
                   rules: tuple = LOGICAL_AXIS_RULES,
                   shardings: Any = None) -> tuple[Any, Any]:
  """Runs `init_fn` (returning a pytree with Flax's logical boxes) under jit with the
  shardings its boxes ask for (or `shardings`), so each device only ever materialises its
  own shards. Returns the unboxed tree and its shardings."""
  if shardings is None:
    shardings = shardings_for(jax.eval_shape(init_fn), mesh, rules)
  tree = jax.jit(lambda: nn.meta.unbox(init_fn()), out_shardings=shardings)()
  return tree, shardings


def abstract(tree: Any) -> Any:
  """Shapes, dtypes and shardings of a tree of arrays: what Orbax restores into (a checkpoint
  saved on any mesh is resharded onto this one)."""
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
      tree)


def initialize_distributed(coordinator_address: str = "", num_processes: int = 0,
                           process_id: int = -1) -> None:
  """Multi-host start-up: one process per host (or per GPU), all running the same program.
  With an empty coordinator address, `jax.distributed.initialize` reads the cluster from the
  environment (Cloud TPU, SLURM, Open MPI, Kubernetes). Once per process: a later call (the
  second stage of a recipe) finds the cluster up and leaves it as it is."""
  if coordinator_address and (num_processes < 1 or not 0 <= process_id < num_processes):
    raise UserError(f"distributed: num_processes={num_processes} and process_id={process_id} "
                    "must satisfy 0 <= process_id < num_processes when coordinator_address "
                    f"={coordinator_address!r} is given")
  if jax.distributed.is_initialized():
    if coordinator_address and (jax.process_count(), jax.process_index()) != (
        num_processes, process_id):
      raise UserError(f"distributed: this process already joined a cluster as process "
                      f"{jax.process_index()} of {jax.process_count()}, not {process_id} of "
                      f"{num_processes}; one process serves one cluster (start a new one)")
    return
  try:
    if coordinator_address:
      jax.distributed.initialize(coordinator_address=coordinator_address,
                                 num_processes=num_processes, process_id=process_id)
    else:   # the cluster's environment says (Cloud TPU, SLURM, ...)
      jax.distributed.initialize()
  except RuntimeError as e:
    if "must be called before" not in str(e):
      raise
    # JAX cannot join a cluster once its backend has started (any jax.devices() or
    # computation): a caller's ordering mistake, reported in one line.
    raise UserError("config.distributed.initialize=True: this process used JAX before "
                    "joining the cluster, and JAX joins one only before its first use; call "
                    "transformer_jax.training.loop.start_distributed(config) before any other "
                    "JAX call, or train in a fresh process") from e
