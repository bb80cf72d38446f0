"""Linen serving conversion: frozen values in, float kernels out.

`convert` runs a model whose aqtr ops are in Mode.CONVERT once and builds
the serving variables: the collection 'aqtr' (int qvalues + scales, static
bounds) and 'params' in which every frozen float kernel is an empty
`aqtr.flax.frozen.FrozenBox` (the one linen frozen container). Re-exported by
`aqtr.flax.linen`.
"""

from __future__ import annotations

import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import meta

from aqtr.flax import common, kinds
from aqtr.flax.frozen import FrozenBox, is_removed
from aqtr.freezers import Mode, lifecycle

FROZEN = common.FROZEN
STATS = common.STATS
PLAN = common.PLAN

HOW_CONVERT = (
  'Produce them with aqtr.flax.linen.convert(model, variables, '
  "*sample_inputs), where the model's ops are in Mode.CONVERT, and apply "
  'the serving variables it returns.'
)
HOW_CALIBRATE = (
  'Apply the model with its ops in Mode.CALIBRATE on sample batches first, '
  f"with mutable=['{STATS}'], and pass the updated '{STATS}' collection "
  'to convert.'
)


OPS_MODE = 'aqtr_ops_mode'  # class attribute: the mode of every aqtr op


def with_ops_mode(model: nn.Module, mode: Mode) -> nn.Module:
  """A copy of linen `model` whose aqtr ops all run in `mode`.

  A linen op's mode is a constructor argument, fixed where the model builds
  it (`functools.partial(DotGeneral, config=cfg, mode=mode)`). The copy's
  class carries `mode` instead (attribute `aqtr_ops_mode`), and each op
  reads it off the root module it runs under, so one model definition
  serves every mode: what `aqtr.flax.convert` returns for linen models
  built from aqtr's ops. The parameter tree is unchanged.

  Example:
    >>> import functools, jax, jax.numpy as jnp, flax.linen as nn, aqtr
    >>> from aqtr.flax.linen import DotGeneral
    >>> dg = functools.partial(DotGeneral, config=aqtr.presets.int8())
    >>> served = with_ops_mode(nn.Dense(3, dot_general_cls=dg), Mode.SERVE)
    >>> type(served).aqtr_ops_mode is Mode.SERVE
    True
  """
  common.check_mode(mode)
  base = getattr(type(model), 'aqtr_ops_base', type(model))
  copy = model.copy()
  copy.__class__ = type(
    base.__name__, (base,), {OPS_MODE: mode, 'aqtr_ops_base': base}
  )
  return copy


def ops_mode(module, mode: Mode) -> Mode:
  """The mode an aqtr op `module` (bound, mode field `mode`) runs in: its
  root module's `aqtr_ops_mode` when set (`with_ops_mode`), else `mode`."""
  root = module
  while kinds.is_linen(getattr(root, 'parent', None)):
    root = root.parent
  return getattr(type(root), OPS_MODE, None) or mode


def convert(model: nn.Module, variables, *args, method=None, **kwargs):
  """Trained variables -> serving variables (int qvalues + scales only).

  Runs `model` (its ops in Mode.CONVERT) once on sample inputs: every op
  writes its frozen values into the collection 'aqtr'; the float kernel of
  each layer whose op froze an rhs that SERVE does not read
  (`Freezer.reads_float` False, e.g. 'weights') is replaced by an empty
  `FrozenBox` (`aqtr.flax.frozen.is_removed`); 'aqtr_stats' is dropped. Apply
  the result to the same model with its ops in Mode.SERVE; the float kernels
  are never read.

  Math: frozen = quantize_operand(kernel) of the op's forward config, so
  SERVE equals TRAIN bit for bit (and `calibration` operands use the
  running mean of CALIBRATE).

  Args:
    model: the model with its quantized ops in Mode.CONVERT.
    variables: {'params': ..., ['aqtr_stats': ...], ...} from training and
      calibration.
    *args, method, **kwargs: sample inputs, as for `model.apply`.

  Returns:
    The serving variables: 'params' without frozen kernels, 'aqtr', and
    any other collections (e.g. 'batch_stats') unchanged.

  Example:
    >>> import functools, jax, jax.numpy as jnp, flax.linen as nn, aqtr
    >>> from aqtr.flax.linen import DotGeneral, Mode
    >>> cfg = aqtr.freezers.configure(aqtr.presets.int8(), rhs='weights')
    >>> make = lambda mode: nn.Dense(3, dot_general_cls=functools.partial(
    ...   DotGeneral, config=cfg, mode=mode))
    >>> x = jnp.ones((2, 4))
    >>> v = make(Mode.TRAIN).init(jax.random.key(0), x)
    >>> s = convert(make(Mode.CONVERT), v, x)
    >>> s['aqtr']['DotGeneral_0'][lifecycle.entry_name(cfg)]['rhs'][
    ...   'qvalue'].dtype, type(s['params']['kernel']).__name__
    (dtype('int8'), 'FrozenBox')
    >>> bool((make(Mode.SERVE).apply(s, x) == make(Mode.TRAIN).apply(v, x)
    ...       ).all())
    True
  """
  serving = serving_or_none(model, variables, *args, method=method, **kwargs)
  if serving is None:
    raise ValueError(
      "convert: no op wrote frozen values. Are the model's aqtr ops in "
      'Mode.CONVERT, and do their configs freeze an operand (e.g. '
      "aqtr.freezers.configure(config, rhs='weights'))?"
    )
  return serving


def serving_or_none(model: nn.Module, variables, *args, method=None, **kwargs):
  """`convert`'s serving variables, or None when no op froze a value."""
  variables = dict(_unfreeze(variables))
  variables.pop(FROZEN, None)
  _check_counts(variables.get(STATS, {}))

  def run(v):  # jitted: eager op-by-op dispatch compiles every primitive
    return model.apply(
      v, *args, mutable=[FROZEN, PLAN], method=method, **kwargs
    )[1]

  new = _unfreeze(jax.jit(run)(variables))
  frozen = new.get(FROZEN, {})
  if not frozen:
    return None
  serving = {k: v for k, v in variables.items() if k != STATS}
  serving[FROZEN] = frozen
  if common.STATE in serving:
    serving[common.STATE] = _drop_frozen_schedules(
      serving[common.STATE], frozen
    )
  serving['params'] = _remove_kernels(
    variables.get('params', {}), new.get(PLAN, {})
  )
  return serving


def _drop_frozen_schedules(state, frozen):
  """The 'aqtr_state' collection without the sparsity schedules (masks as
  large as the kernels) of frozen operands: SERVE reads their stored
  values, already pruned, never the mask."""
  if not isinstance(state, dict) or not isinstance(frozen, dict):
    return state
  out = {}
  for name, value in state.items():
    sub = frozen.get(name)
    if name == 'stats' and isinstance(value, dict):
      sides = {
        side
        for entry in (frozen.values() if isinstance(frozen, dict) else ())
        if isinstance(entry, dict)
        for side in ('lhs', 'rhs')
        if side in entry
      }
      value = {
        p: v
        for p, v in value.items()
        if p not in {f'fwd.{side}.sparsity' for side in sides}
      }
    elif isinstance(value, dict):
      value = _drop_frozen_schedules(value, sub if sub is not None else {})
    out[name] = value
  return out


def _check_counts(stats, path=()):
  """CALIBRATE statistics that were created but never updated: an error."""
  if isinstance(stats, dict):
    count = stats.get('count')
    if count is not None and not isinstance(count, dict):
      try:
        empty = int(count) == 0
      except jax.errors.ConcretizationTypeError:
        empty = False  # traced under jit: checked when run eagerly
      if empty:
        raise ValueError(
          f'convert: the CALIBRATE statistics at /{"/".join(path)} have '
          f'count 0. {HOW_CALIBRATE}'
        )
    for k, v in stats.items():
      _check_counts(v, path + (k,))


def _unfreeze(tree):
  if hasattr(tree, 'unfreeze'):
    return tree.unfreeze()
  if isinstance(tree, dict):
    return {k: _unfreeze(v) for k, v in tree.items()}
  return tree


def _frozen_rhs(frozen, path=()):
  """Yields (op path, frozen rhs part) for every op that froze its rhs."""
  for k, v in frozen.items():
    if str(k).startswith(lifecycle.PREFIX) and isinstance(v, dict):
      if isinstance(v.get('rhs'), dict):
        yield path, v['rhs']
    elif isinstance(v, dict):
      yield from _frozen_rhs(v, path + (k,))


def _removable(plan, path=()):
  """Yields (op path, rhs size) for every op whose float rhs can go."""
  for k, v in plan.items():
    if k == 'rhs_size' and not isinstance(v, dict):
      yield path, jnp.shape(v)[0]
    elif isinstance(v, dict):
      yield from _removable(v, path + (k,))


def _remove_kernels(params, plan):
  params = _unfreeze(params)
  for op_path, size in _removable(plan):
    node = params
    for k in op_path[:-1]:
      node = node.get(k, {}) if isinstance(node, dict) else {}
    kernel = node.get('kernel') if isinstance(node, dict) else None
    if kernel is not None and not is_removed(kernel):
      kernel = meta.unbox(kernel)
    if kernel is None or is_removed(kernel):
      warnings.warn(
        f'convert: the op at /{"/".join(op_path)} froze its rhs, but its '
        "parent has no 'kernel' parameter; nothing was removed there.",
        stacklevel=3,
      )
      continue
    if jnp.size(kernel) != size:
      raise ValueError(
        f'convert: the op at /{"/".join(op_path)} froze an rhs of '
        f"{size} values but its parent's kernel has "
        f'{jnp.size(kernel)}; the rhs is not the kernel.'
      )
    node['kernel'] = FrozenBox.removed(jnp.shape(kernel), kernel.dtype)
  return params


def _at(tree, path):
  for k in path:
    tree = tree.get(k) if isinstance(tree, dict) else None
  return tree


def frozen_kernels(serving) -> list[tuple[int, Any]]:
  """(bytes of the removed float kernel, its frozen values) per layer
  `convert` froze in the serving variables; `aqtr.flax.sizes` sums them.

  Example:
    >>> import jax.numpy as jnp
    >>> box = FrozenBox.removed((4, 3), jnp.float32)
    >>> frozen_kernels({'params': {'kernel': box}})
    [(48, [])]
  """
  params = _unfreeze(serving.get('params', {}))
  parts: dict[tuple, list] = {}
  for path, part in _frozen_rhs(serving.get(FROZEN, {})):
    parts.setdefault(tuple(path[:-1]), []).append(part)
  out = []
  flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_removed)[0]
  for keys, x in flat:
    if is_removed(x):
      path = tuple(getattr(k, 'key', k) for k in keys)[:-1]
      out.append((common.removed_bytes(x.shape, x.dtype), parts.get(path, [])))
  return out


__all__ = [
  'FROZEN',
  'OPS_MODE',
  'PLAN',
  'STATS',
  'convert',
  'frozen_kernels',
  'ops_mode',
  'serving_or_none',
  'with_ops_mode',
]
