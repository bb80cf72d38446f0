"""The quantized dot on JAX meshes: explicit axes, shard_map, checks.

`dot_general` runs its custom VJP the same way under every kind of mesh:

- Auto axes (or no mesh): the compiler propagates shardings; scales get
  their operand's sharding (a per-row scale of an M-sharded lhs is
  M-sharded), and `out_sharding` becomes a sharding constraint.
- Explicit axes (the default of `jax.make_mesh`): the output's sharding is
  the one `lax.dot_general` would give (or `out_sharding`), and the
  quantized passes, whose internal reshapes and int8 dots have no explicit
  sharding rule of their own, run with the mesh's explicit axes viewed as
  auto inside (`jax.sharding.auto_axes`); the gradients come back with
  their operands' shardings.
- `jax.shard_map` with `check_vma=True`: each device runs the dot on its
  blocks. An operand that is invariant along a manual axis its cotangent
  varies along gets that cotangent summed over the axis (the transpose of
  the implicit broadcast, as lax does), and one that varies along an axis
  its cotangent does not is given the varying type:

    dL = psum_{vma(dL) - vma(L)} dL

Internal API (used by `dot_general.py` and `ragged_dot.py`):
`explicit_axes`, `output_type`, `run_on_mesh`, `run_typed`, `vma_of`,
`check_out_sharding`, `check_dot_out_sharding`,
`check_einsum_out_sharding`,
`match_vma`, `zeros_varying`, `check_tiles`, `check_meshes`,
`check_operands`, `permute_sharding`, `constrain`,
`gather_specs`, `keep_on_shards`; `collectives` reads a compiled module's
collective ops and their bytes.

Quantized communication (`TensorConfig.quantized_gather`): an operand
sharded over the devices that all need it whole (FSDP) is quantized where
its shards live and its int8 values and f32 scales are gathered:

  gather(q(W)) * gather(s(W)) == q(gather(W)) * s(gather(W))

(a per-channel scale reduces over K: when K is sharded its max is one small
all-reduce of the scales).
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType

from aqtr.core import prims


def explicit_axes(*operands) -> tuple[str, ...]:
  """The current mesh's explicit axes (empty without a mesh).

  Without a mesh set (`jax.set_mesh`), the mesh of the first of `operands`
  that has one (explicitly sharded arrays carry theirs).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    mesh = _operand_mesh(operands)
  if mesh is None or mesh.empty:
    return ()
  return tuple(
    n
    for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
    if t == AxisType.Explicit
  )


def output_type(lhs, rhs, dimension_numbers, preferred, out_sharding):
  """The type (with sharding) `lax.dot_general` gives; lax's own errors.

  `lhs`/`rhs` are arrays or ShapeDtypeStructs (a stored QTensor is seen as
  its replicated float shape).
  """

  def dot(a, b):
    return prims.dot_general(
      a,
      b,
      dimension_numbers,
      preferred_element_type=preferred,
      out_sharding=out_sharding,
    )

  return jax.eval_shape(dot, lhs, rhs)


def _mesh_of(x):
  """The (abstract) mesh `x`'s type is sharded on, or None."""
  x = getattr(x, 'qvalue', x)  # A stored QTensor: its values' mesh.
  if not hasattr(x, 'shape'):
    return None
  mesh = getattr(getattr(jax.typeof(x), 'sharding', None), 'mesh', None)
  return None if mesh is None or mesh.empty else mesh


def _operand_mesh(operands):
  return next(filter(None, map(_mesh_of, operands)), None)


def _axes(mesh) -> str:
  return ', '.join(f'{n}={k}' for n, k in mesh.shape.items())


def check_meshes(lhs, rhs) -> None:
  """Raises when the operands lie on different meshes, or on a mesh other
  than the one `jax.set_mesh` set (compared by axis names and sizes)."""
  context = jax.sharding.get_abstract_mesh()
  seen = []
  for name, x in (('lhs', lhs), ('rhs', rhs)):
    mesh = _mesh_of(x)
    if mesh is None:
      continue
    if not context.empty and dict(mesh.shape) != dict(context.shape):
      raise ValueError(
        f'{name} is sharded on a mesh with axes ({_axes(mesh)}), but the '
        f'mesh set by jax.set_mesh has axes ({_axes(context)}); put it on '
        'that mesh (jax.device_put / jax.sharding.reshard).'
      )
    seen.append((name, mesh))
  if len(seen) == 2 and dict(seen[0][1].shape) != dict(seen[1][1].shape):
    raise ValueError(
      f'rhs is sharded on a mesh with axes ({_axes(seen[1][1])}), but lhs '
      f'on one with axes ({_axes(seen[0][1])}); put both operands on one '
      'mesh.'
    )


def vma_of(x) -> frozenset:
  """The manual mesh axes `x` varies along (empty outside shard_map)."""
  if not isinstance(x, jax.Array):
    return frozenset()
  aval = jax.typeof(x)
  mat = getattr(aval, 'mat', None)  # JAX >= 0.10: the manual axis type.
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, 'vma', None) or ())


def match_vma(grad: jax.Array, vma: frozenset) -> jax.Array:
  """A cotangent given the primal's varying-manual-axes type.

  Summed over the axes the cotangent varies along and the primal does not;
  marked varying along the axes only the primal varies along.
  """
  have = vma_of(grad)
  extra = tuple(sorted(have - vma))
  if extra:
    grad = lax.psum(grad, extra)
  missing = tuple(sorted(vma - have))
  if missing:
    grad = lax.pcast(grad, missing, to='varying')
  return grad


def _spec_axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def check_tiles(x, contracting, tile: int | None, name: str) -> None:
  """Raises when an explicit sharding splits a K tile across devices.

  A quantization tile (sub-channel block, MX block, local shard) must lie
  on one device: the product of the mesh axes sharding the (single)
  contracting axis must divide K / tile. Only explicit shardings are
  visible at trace time; auto shardings are the compiler's to choose.
  """
  if tile is None:
    return
  sharding = getattr(jax.typeof(x), 'sharding', None)
  spec = getattr(sharding, 'spec', None)
  if not spec or sharding.mesh.empty:
    return
  mesh = sharding.mesh
  sizes = [x.shape[a] for a in contracting]
  for i, axis in enumerate(contracting):
    axes = _spec_axes(spec[axis]) if axis < len(spec) else ()
    if not axes:
      continue
    n = math.prod(mesh.shape[a] for a in axes)
    block = sizes[i] // n * math.prod(sizes[i + 1 :])
    if block % tile:
      raise ValueError(
        f'{name}: contracting axis {axis} (size {sizes[i]}) sharded over '
        f'mesh axis {"x".join(axes)} ({n} devices) splits a quantization '
        f'tile of {tile} along K; shard K in whole tiles or change the '
        'tiling.'
      )


def check_out_sharding(out_sharding, rank: int, what: str) -> None:
  """Raises unless `out_sharding`'s spec has at most `rank` entries.

  Args:
    out_sharding: None, a PartitionSpec or a NamedSharding.
    rank: the rank of the output it describes.
    what: the output's layout for the message, e.g. '[M, N] of ragged_dot'.
  """
  spec = getattr(out_sharding, 'spec', out_sharding)
  if not isinstance(spec, jax.sharding.PartitionSpec) or len(spec) <= rank:
    return
  raise ValueError(
    f'out_sharding {spec} has {len(spec)} entries, but the output is '
    f'{rank}-D ({what}); give at most {rank}, one per output axis.'
  )


def check_dot_out_sharding(out_sharding, lhs, rhs, dimension_numbers):
  """`check_out_sharding` for dot_general's output (stored QTensor
  operands count with their float shape); bad dimension numbers are left
  to the layout checks."""
  if out_sharding is None:
    return
  try:
    (lc, rc), (lb, _) = dimension_numbers
    ranks = [
      len(x.layout.shape if hasattr(x, 'layout') else jnp.shape(x))
      for x in (lhs, rhs)
    ]
    rank = sum(ranks) - len(lc) - len(rc) - len(lb)
  except (TypeError, ValueError):
    return
  check_out_sharding(
    out_sharding, rank, 'dot_general: [batch..., lhs free..., rhs free...]'
  )


def check_einsum_out_sharding(out_sharding, subscripts) -> None:
  """`check_out_sharding` for an einsum with explicit output letters."""
  if out_sharding is None or not isinstance(subscripts, str):
    return
  if '->' not in subscripts or '.' in subscripts:
    return  # Implicit output or ellipsis: left to lax.
  out = subscripts.split('->')[1].replace(' ', '')
  check_out_sharding(out_sharding, len(out), f'einsum output {out!r}')


def permute_sharding(sharding, perm):
  """`sharding` (NamedSharding, PartitionSpec or None) of an array whose
  axis i is axis perm[i] of the array `sharding` describes."""
  if sharding is None:
    return None
  check_out_sharding(sharding, len(perm), f'{len(perm)} axes')
  spec = getattr(sharding, 'spec', sharding)
  entries = tuple(spec) + (None,) * (len(perm) - len(spec))
  new = jax.sharding.PartitionSpec(*(entries[p] for p in perm))
  if isinstance(sharding, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(sharding.mesh, new)
  return new


def constrain(x: jax.Array, sharding) -> jax.Array:
  """`x` with `sharding`: a reshard under explicit axes, else a constraint."""
  if sharding is None:
    return x
  check_out_sharding(sharding, x.ndim, f'shape {tuple(x.shape)}')
  if explicit_axes():
    return jax.sharding.reshard(x, sharding)
  return lax.with_sharding_constraint(x, sharding)


def _entry_axes(spec, axis: int) -> tuple[str, ...]:
  return _spec_axes(spec[axis]) if axis < len(spec) else ()


def gather_specs(lhs, rhs, fwd):
  """The operands' PartitionSpecs where `quantized_gather` applies, or None.

  Read from the explicit sharding types (outside `auto_axes`); a QTensor
  operand or an operand without `quantized_gather` gets None.
  """
  if not explicit_axes(lhs, rhs):
    return None
  specs = []
  for x, cfg in ((lhs, fwd.lhs), (rhs, fwd.rhs)):
    spec = None
    if cfg.quantized_gather and cfg.quantized and hasattr(x, 'shape'):
      sharding = getattr(jax.typeof(x), 'sharding', None)
      spec = tuple(getattr(sharding, 'spec', None) or ()) or None
    specs.append(spec)
  return None if specs == [None, None] else tuple(specs)


def keep_on_shards(q: dict, plan) -> dict:
  """{side: quantized operand} pinned to their shards where the plan has
  a `quantized_gather` PartitionSpec (`gather_specs`)."""
  out = {}
  for side, x in q.items():
    op = plan.operand(side)
    out[side] = _keep_on_shards(x, op.layout, op.gather)
  return out


def _keep_on_shards(q, layout, spec):
  """Pins a quantized operand's values and scale to its float sharding.

  `q` is a passes.QuantizedOperand in the tiled view [B, T, F, t] ('fk') or
  [B, T, t, F] ('kf') of an operand with `layout` and PartitionSpec `spec`.
  Each of B, F, K takes the sharding of its leading axis (K's goes to T when
  there are several tiles, else to t); an operand sharded on another axis
  of a merged group is left to the compiler.
  """
  if spec is None or q.scale is None:
    return q
  groups = {}
  for role, axes in (
    ('b', layout.batch),
    ('f', layout.free),
    ('k', layout.contract),
  ):
    names = [_entry_axes(spec, a) for a in axes]
    if any(names[1:]):
      return q
    groups[role] = (names[0] or None) if names else None
  tiled = q.values.shape[1] > 1
  t_spec = None if tiled else groups['k']
  n_spec = groups['k'] if tiled else None
  if q.form == 'fk':
    view = (groups['b'], n_spec, groups['f'], t_spec)
  else:
    view = (groups['b'], n_spec, t_spec, groups['f'])

  def pin(x):
    if x is None:
      return None
    entries = [
      None if d == 1 or e is None else (e if len(e) > 1 else e[0])
      for d, e in zip(x.shape, view, strict=True)
    ]
    return lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(*entries))

  return dataclasses.replace(q, values=pin(q.values), scale=pin(q.scale))


_COLLECTIVE = re.compile(
  r'= (\([^=\n]*?\)|[a-z0-9]+\[[0-9,]*\]\S*) '
  r'(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)'
  r'(?:-start)?\('
)
_ARRAY = re.compile(r'([a-z][a-z0-9]*)\[([0-9,]*)\]')
_BITS = {'pred': 8, 's4': 4, 'u4': 4}


def _bytes(dtype: str, dims: str) -> int:
  n = math.prod(int(d) for d in dims.split(',') if d)
  bits = _BITS.get(dtype) or int(re.sub('[^0-9]', '', dtype) or 32)
  return n * bits // 8


def collectives(hlo_text: str) -> list[tuple[str, str, int]]:
  """(op, dtype, result bytes) of each collective in an HLO module's text.

  The bytes are those of the op's results per device (summed over a tuple;
  the dtype is the first result's): for an all-gather the gathered array,
  for an all-reduce the reduced one.

  Example:
    >>> collectives('%a = s8[4,8]{1,0} all-gather(%b), dimensions={0}')
    [('all-gather', 's8', 32)]
  """
  out = []
  for m in _COLLECTIVE.finditer(hlo_text):
    arrays = _ARRAY.findall(m.group(1))
    nbytes = sum(_bytes(d, dims) for d, dims in arrays)
    out.append((m.group(2), arrays[0][0], nbytes))
  return out


def run_on_mesh(run, args, structs, plan, out_sharding, state=None):
  """`run(*args)`, the quantized dot, with lax's output sharding.

  Explicit axes: the output type lax gives `structs` (or `out_sharding`),
  `run` inside `auto_axes`. Otherwise `out_sharding` is a constraint.
  With calibration `state` (the last of `args`), `run` returns
  (out, new_state) and the new state is replicated like the state.
  """

  def out_type():
    return output_type(
      *structs, plan.dimension_numbers, plan.preferred, out_sharding
    )

  return run_typed(run, args, out_type, out_sharding, state)


def run_typed(run, args, out_type, out_sharding, state=None):
  """`run(*args)` with the output type `out_type()` (a ShapeDtypeStruct
  with lax's sharding, asked for under explicit axes only); `args[:2]` are
  the operands; `state` as in `run_on_mesh`."""
  if jax.sharding.get_abstract_mesh().empty and explicit_axes(*args[:2]):
    # Explicitly sharded operands, no mesh set: run under theirs.
    with jax.sharding.use_abstract_mesh(_operand_mesh(args[:2])):
      return run_typed(run, args, out_type, out_sharding, state)
  if explicit_axes():
    sharding = out_type().sharding
    if state is not None:
      sharding = (sharding, jax.tree.map(lambda _: jax.P(), state))
    return jax.sharding.auto_axes(run, out_sharding=sharding)(*args)
  if state is not None:
    out, new_state = run(*args)
    return constrain(out, out_sharding), new_state
  return constrain(run(*args), out_sharding)


def zeros_varying(struct, vma: frozenset) -> jax.Array:
  """Zeros of `struct` with the varying-manual-axes type `vma`."""
  return match_vma(jnp.zeros(struct.shape, struct.dtype), vma)


def check_operands(lhs, rhs, plan) -> None:
  """`check_meshes`, then `check_tiles` for both float operands (a stored
  QTensor is skipped), with the plan's forward tile."""
  check_meshes(lhs, rhs)
  for x, op, name in ((lhs, plan.lhs, 'lhs'), (rhs, plan.rhs, 'rhs')):
    if not op.stored:
      check_tiles(x, op.layout.contract, plan.fwd_tile, name)
