"""Flax nnx adapters: quantized ops for Linear, LinearGeneral, Einsum, Conv.

Give each layer its own op instance (the op holds the layer's frozen values
and statistics; nnx's `dot_general_cls` builds a fresh op per call, which
cannot keep state, so pass `dot_general=`):

  nnx.Linear(4, 8, dot_general=DotGeneral(cfg), rngs=rngs)
  nnx.LinearGeneral(4, (2, 8), dot_general=DotGeneral(cfg), rngs=rngs)
  nnx.Einsum('btd,df->btf', (4, 8), einsum_op=Einsum(cfg), rngs=rngs)
  nnx.Conv(3, 16, (3, 3), conv_general_dilated=ConvGeneralDilated(cfg),
           rngs=rngs)

nnx passes `out_sharding=` to injected ops; they accept it (a sharding
constraint on the output). Modes as in `aqtr.flax.linen` (the math is in
`aqtr.freezers.lifecycle`): `set_mode(model, Mode.CALIBRATE)` makes the ops
keep `Stats` variables; `convert(model, *sample_inputs)` writes `Frozen`
variables, switches the ops to SERVE and replaces each frozen float kernel by an
empty `Frozen` holder (no array; reads as zeros of its shape, dropped by XLA
under jit; `aqtr.flax.frozen`). `nnx.state(model)` is then the serving state.

Stochastic rounding: pass `rngs=nnx.Rngs(quant=seed)` to the op; it is
required only when the config rounds stochastically.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aqtr.core.config import DotGeneralConfig
from aqtr.flax import common
from aqtr.flax.frozen import Frozen, is_holder, is_removed
from aqtr.freezers import Mode, lifecycle
from aqtr.state import merge_tree

_HOW_CONVERT = (
  'Produce them with aqtr.flax.nnx.convert(model, *sample_inputs) on the '
  'trained model (it switches the ops to Mode.SERVE).'
)
_HOW_CALIBRATE = (
  'Run aqtr.flax.nnx.set_mode(model, Mode.CALIBRATE) and call the model on '
  'sample batches first.'
)


class Stats(nnx.Variable):
  """CALIBRATE statistics of one operand of an aqtr op: {mean, count}."""


class CalibState(nnx.Variable):
  """Stats of an op's stateful calibrations: {operand path: stats}.

  Differentiate the loss w.r.t. these too (`nnx.DiffState`) and pass the
  gradients to `update_state`: they carry the backward passes' new stats.
  """


class _Op(nnx.Module):
  """Shared state and mode machinery of the nnx ops.

  Args:
    config: the DotGeneralConfig; None is the plain lax / jnp op.
    mode: an aqtr.Mode (change it with `set_mode`).
    rngs: nnx.Rngs with the stream `rng_name`, used only when the config
      rounds stochastically.
    rng_name: the stream's name.
  """

  def __init__(
    self,
    config: DotGeneralConfig | None = None,
    *,
    mode: Mode = Mode.TRAIN,
    rngs: nnx.Rngs | None = None,
    rng_name: str = common.RNG,
  ):
    if config is not None:
      lifecycle.validate(config)
    common.check_mode(mode)
    self.config = config
    self.mode = mode
    self.rng_name = rng_name
    self.rngs = rngs

  def frozen_entries(self) -> dict:
    """{entry name: frozen values} held by this op."""
    return {
      k: v.get_value() for k, v in vars(self).items() if isinstance(v, Frozen)
    }

  def drop_variables(self, kind) -> None:
    """Deletes every variable of type `kind` (e.g. Frozen) from this op."""
    for k in [k for k, v in vars(self).items() if isinstance(v, kind)]:
      delattr(self, k)


class _OpHost(common.OpHost):
  """The shared op body's view of an nnx op (its variables are attributes)."""

  frozen_collection = 'Frozen variables'
  how_convert = _HOW_CONVERT
  how_calibrate = _HOW_CALIBRATE

  def __init__(self, op: _Op):
    self.op, self.config, self.mode = op, op.config, op.mode
    self.where = f'{type(op).__name__} (nnx)'

  def frozen_entries(self):
    return self.op.frozen_entries()

  def stats(self, mode):
    del mode
    return {
      k[len('stats_') :]: v.get_value()
      for k, v in vars(self.op).items()
      if isinstance(v, Stats)
    }

  def calib_state(self, make):
    op = self.op
    if not isinstance(getattr(op, common.STATE, None), CalibState):
      stats, learned = make()
      setattr(op, common.STATE, CalibState(stats))
      if learned:
        setattr(op, common.LEARNED, nnx.Param(learned))
    learned = getattr(op, common.LEARNED, None)
    return common.assemble(
      getattr(op, common.STATE).get_value(),
      {} if learned is None else learned.get_value(),
    )

  def store(self, result):
    op = self.op
    if result.state is not None and self.mode in (Mode.TRAIN, Mode.CALIBRATE):
      getattr(op, common.STATE).set_value(common.stats_of(result.state))
    for side, value in (result.stats or {}).items():
      name = f'stats_{side}'
      if isinstance(getattr(op, name, None), Stats):
        getattr(op, name).set_value(value)
      else:
        setattr(op, name, Stats(value))
    if result.frozen is not None:
      op.drop_variables(Frozen)
      setattr(op, lifecycle.entry_name(self.config), Frozen(result.frozen))

  def mark_removable(self, rhs_shape):
    for v in vars(self.op).values():
      if isinstance(v, Frozen):
        v.set_metadata('rhs_size', math.prod(rhs_shape))

  def draw_key(self):
    rngs = self.op.rngs
    if rngs is not None:
      try:
        return rngs[self.op.rng_name]()
      except KeyError:
        pass
    return None

  def missing_key(self) -> str:
    return (
      f'PRNG keys: build the op with rngs=nnx.Rngs({self.op.rng_name}=seed).'
    )


class DotGeneral(_Op):
  """`lax.dot_general` for `nnx.Linear` / `nnx.LinearGeneral(dot_general=)`.

  The kernel is the dot's rhs: `config.fwd.rhs` quantizes (and freezes) it.

  Example:
    >>> import jax.numpy as jnp, aqtr
    >>> from flax import nnx
    >>> layer = nnx.Linear(4, 3, dot_general=DotGeneral(aqtr.presets.int8()),
    ...                    rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((2, 4))).shape
    (2, 3)
  """

  def __call__(
    self,
    lhs,
    rhs,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    out_sharding=None,
  ):
    return common.dot_general_op(
      _OpHost(self),
      lhs,
      rhs,
      dimension_numbers,
      precision,
      preferred_element_type,
      out_sharding,
    )


class Einsum(_Op):
  """Two-operand `jnp.einsum` for `nnx.Einsum(einsum_op=)`.

  Example:
    >>> import jax.numpy as jnp, aqtr
    >>> from flax import nnx
    >>> layer = nnx.Einsum('btd,df->btf', (4, 5), (5,),
    ...                    einsum_op=Einsum(aqtr.presets.int8()),
    ...                    rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((2, 3, 4))).shape
    (2, 3, 5)
  """

  def __call__(
    self,
    subscripts,
    lhs,
    rhs,
    precision=None,
    preferred_element_type=None,
    out_sharding=None,
    optimize=None,
  ):
    del optimize  # One dot: nothing to optimize.
    return common.einsum_op(
      _OpHost(self),
      subscripts,
      lhs,
      rhs,
      precision,
      preferred_element_type,
      out_sharding,
    )


class ConvGeneralDilated(_Op):
  """`lax.conv_general_dilated` for `nnx.Conv(conv_general_dilated=)`.

  im2col + one quantized dot: forward and both gradients are quantized.

  Example:
    >>> import jax, jax.numpy as jnp, aqtr
    >>> from flax import nnx
    >>> op = ConvGeneralDilated(aqtr.presets.int8())
    >>> layer = nnx.Conv(2, 4, (3, 3), conv_general_dilated=op,
    ...                  rngs=nnx.Rngs(0))
    >>> jax.eval_shape(layer, jnp.ones((1, 6, 6, 2))).shape  # shapes only
    (1, 6, 6, 4)
  """

  def __call__(self, lhs, rhs, *args, **kwargs):
    """As `lax.conv_general_dilated` (see `aqtr.core.conv.ConvArgs`)."""
    return common.conv_op(_OpHost(self), lhs, rhs, *args, **kwargs)


def ops(model: nnx.Module) -> list[tuple[tuple, _Op]]:
  """(path, op) of every aqtr op in `model` (each shared op once)."""
  return [(p, m) for p, m in nnx.iter_modules(model) if isinstance(m, _Op)]


def set_mode(model: nnx.Module, mode: Mode) -> nnx.Module:
  """Sets the mode of every aqtr op in `model` (in place); returns it."""
  common.check_mode(mode)
  for _, op in ops(model):
    op.mode = mode
  return model


def convert(model: nnx.Module, *args, **kwargs) -> nnx.Module:
  """Freezes `model` in place for serving and returns it.

  Calls `model(*args, **kwargs)` once with the ops in Mode.CONVERT (each op
  stores `Frozen` values: quantize_operand of 'weights' operands, the
  CALIBRATE mean of 'calibration' operands), drops the `Stats`, switches the
  ops to Mode.SERVE and replaces the `kernel` of each layer whose op froze
  its rhs by an empty `Frozen` holder (`aqtr.flax.frozen.is_removed`).
  SERVE output equals TRAIN's bit for bit.

  Example:
    >>> import jax.numpy as jnp, aqtr
    >>> from flax import nnx
    >>> cfg = aqtr.freezers.configure(aqtr.presets.int8(), rhs='weights')
    >>> m = nnx.Linear(4, 3, dot_general=DotGeneral(cfg), rngs=nnx.Rngs(0))
    >>> x = jnp.ones((2, 4))
    >>> y = m(x)
    >>> m = convert(m, x)
    >>> type(m.kernel).__name__, bool((m(x) == y).all())
    ('Frozen', True)
  """
  found = ops(model)
  before = [op.mode for _, op in found]
  try:
    for _, op in found:
      op.drop_variables(Frozen)
      op.mode = Mode.CONVERT
      for k, v in vars(op).items():
        count = v.get_value()['count'] if isinstance(v, Stats) else None
        if count is not None and not np.asarray(count).all():
          raise ValueError(
            f'convert: the CALIBRATE statistics {k} have count 0. '
            f'{_HOW_CALIBRATE}'
          )
    # Jitted: eager op-by-op dispatch would compile every primitive.
    nnx.jit(lambda m: m(*args, **kwargs))(model)
  except BaseException:
    for (_, op), mode in zip(found, before, strict=True):
      op.mode = mode
    raise
  for _, op in found:
    op.mode = Mode.SERVE
    op.drop_variables(Stats)
  if not any(op.frozen_entries() for _, op in found):
    raise ValueError(
      'convert: no op wrote frozen values. Does the model hold aqtr.flax.nnx '
      'ops whose configs freeze an operand (aqtr.freezers.configure(config, '
      "rhs='weights'))?"
    )
  for _, parent in nnx.iter_modules(model):
    for child in list(vars(parent).values()):
      if isinstance(child, _Op):
        _remove_kernel(parent, child)
  return model


def _frozen_rhs(op: _Op):
  """(frozen rhs part, rhs size) when serving does not read the float rhs."""
  if op.config is None or not lifecycle.removable(op.config):
    return None, 0
  for v in vars(op).values():
    if isinstance(v, Frozen) and 'rhs_size' in v.get_metadata():
      return v.get_value().get('rhs'), v.get_metadata('rhs_size')
  return None, 0


def _remove_kernel(parent, op: _Op) -> None:
  part, size = _frozen_rhs(op)
  kernel = getattr(parent, 'kernel', None)
  if part is None or not isinstance(kernel, nnx.Variable):
    return
  if is_holder(kernel) or is_removed(kernel):
    return
  value = kernel.get_value()
  if jnp.size(value) != size:
    raise ValueError(
      f"convert: {type(parent).__name__}'s op froze an rhs of "
      f'{size} values but its kernel has {jnp.size(value)}; the rhs is not '
      'the kernel.'
    )
  parent.kernel = Frozen.holder(None, shape=value.shape, dtype=value.dtype)


def update_state(model: nnx.Module, grads) -> nnx.Module:
  """Writes the backward passes' new calibration stats into `model`.

  `grads`: the gradient State of a loss w.r.t. the model's `CalibState`
  variables (e.g. `nnx.grad(loss, argnums=nnx.DiffState(0,
  nnx.Any(nnx.Param, CalibState)))`); the forward stats were already
  updated in place by the call. The ops create their `CalibState` on
  their first call: call the model once (e.g. on a sample batch) before
  differentiating. Returns the model.

  Example:
    >>> import jax.numpy as jnp, aqtr
    >>> from flax import nnx
    >>> m = nnx.Linear(8, 2, rngs=nnx.Rngs(0),
    ...                dot_general=DotGeneral(aqtr.presets.fp8_delayed()))
    >>> x = jnp.ones((2, 8))
    >>> _ = m(x)  # creates the state
    >>> diff = nnx.DiffState(0, nnx.Any(nnx.Param, CalibState))
    >>> grads = nnx.grad(lambda m: m(x).sum(), argnums=diff)(m)
    >>> h = update_state(m, grads).dot_general.aqtr_state.get_value()
    >>> bool(h['dlhs.lhs']['history'].max() > 0)
    True
  """
  current = nnx.state(model, CalibState)
  g_state = nnx.filter_state(grads, CalibState)
  if jax.tree.structure(current) != jax.tree.structure(g_state):
    raise ValueError(
      'update_state: grads do not hold the gradient of every CalibState '
      'of the model; differentiate w.r.t. nnx.Any(nnx.Param, CalibState) '
      '(nnx.DiffState), and call the model once before differentiating '
      '(the ops create their CalibState on their first call).'
    )
  nnx.update(model, merge_tree(current, g_state))
  return model


def frozen_kernels(model: nnx.Module) -> list[tuple[int, Any]]:
  """(bytes of the removed float kernel, its frozen values) per layer that
  `convert` froze; `aqtr.flax.sizes` sums them."""
  out = []
  for _, m in nnx.iter_modules(model):
    k = getattr(m, 'kernel', None)
    if not is_removed(k):
      continue
    parts = [_frozen_rhs(c)[0] for c in vars(m).values() if isinstance(c, _Op)]
    out.append(
      (
        common.removed_bytes(
          k.get_metadata('kernel_shape'), k.get_metadata('kernel_dtype')
        ),
        [p for p in parts if p is not None],
      )
    )
  return out


__all__ = [
  'CalibState',
  'ConvGeneralDilated',
  'DotGeneral',
  'Einsum',
  'Frozen',
  'Mode',
  'Stats',
  'convert',
  'frozen_kernels',
  'ops',
  'set_mode',
  'update_state',
]
