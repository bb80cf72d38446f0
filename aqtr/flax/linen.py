"""Flax linen adapters: quantized ops for Dense, DenseGeneral, Einsum, Conv.

Inject an op into a stock layer; its `mode` (aqtr.Mode) decides what runs:

  dg = functools.partial(DotGeneral, config=cfg, mode=Mode.TRAIN)
  nn.Dense(10, dot_general_cls=dg)
  nn.DenseGeneral((4, 8), dot_general_cls=dg)
  nn.Conv(16, (3, 3), conv_general_dilated_cls=functools.partial(
      ConvGeneralDilated, config=cfg, mode=mode))
  EinsumDense((8, 4), 'btd,df->btf', einsum_cls=functools.partial(
      Einsum, config=cfg, mode=mode))      # nn.Einsum has no injection point

Modes (aqtr.freezers.lifecycle has the math): TRAIN quantizes on the fly;
CALIBRATE also updates the collection 'aqtr_stats' (apply with
mutable=['aqtr_stats']); CONVERT writes the frozen values into the
collection 'aqtr' (use `convert`); SERVE reads them. What is frozen is
chosen per operand by `config.fwd.{lhs,rhs}.freezer`, e.g.
`aqtr.freezers.configure(cfg, rhs='weights')`. The mode is a module field:
build the model once per mode (the parameters are shared).

`convert` returns serving variables in which each frozen float kernel is an
empty `aqtr.flax.frozen.FrozenBox` (no array; it reads as zeros of its shape,
which XLA drops under jit): the serving tree holds int8/int4 qvalues and scales
only.

Stochastic rounding draws keys from the rng stream `rng_name` ('quant'),
needed only when the config rounds stochastically (the backward passes only
in TRAIN).
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from aqtr.core.config import DotGeneralConfig
from aqtr.flax import common, linen_convert
from aqtr.flax.linen_convert import (
  FROZEN,
  HOW_CALIBRATE,
  HOW_CONVERT,
  PLAN,
  STATS,
  convert,
)
from aqtr.freezers import Mode, lifecycle

# Stateful calibrations: their stats live in the collection 'aqtr_state',
# learned parameters in the param 'aqtr_learned' of each op.
STATE = common.STATE
LEARNED = common.LEARNED


class LinenOpHost(common.OpHost):
  """The shared op body's view of a linen module (aqtr.flax and aqtr.pax).

  Frozen entries live in the collection 'aqtr', CALIBRATE statistics in
  'aqtr_stats'; CONVERT also notes, in 'aqtr_convert', the size of each
  rhs that serving does not read, for `convert` to drop the float kernel.

  Args:
    module: the linen op (inside its `nn.compact` call).
    config, mode: the op's.
    rng_name: the rng stream of stochastic rounding.
    where: the op's name for messages (default: class and path).
    missing_key: the end of the message when a key is needed and missing.
  """

  frozen_collection = FROZEN
  how_convert = HOW_CONVERT
  how_calibrate = HOW_CALIBRATE

  def __init__(
    self, module, config, mode, rng_name, where=None, missing_key=None
  ):
    self.module, self.config = module, config
    self.mode = linen_convert.ops_mode(module, mode)
    self.rng_name = rng_name
    self.where = where or (
      f'{type(module).__name__} at /{"/".join(map(str, module.path))}'
    )
    self._missing = missing_key or (
      f'the PRNG stream {rng_name!r}: pass rngs={{{rng_name!r}: key}} to apply.'
    )

  @property
  def initializing(self) -> bool:
    return self.module.is_initializing()

  def frozen_entries(self):
    return self.module.variables.get(FROZEN)

  def stats(self, mode):
    need = STATS if mode is Mode.CALIBRATE else FROZEN
    if not self.module.is_mutable_collection(need):
      if mode is Mode.CALIBRATE:
        raise ValueError(
          f'{self.where}: CALIBRATE updates the collection {STATS!r}; apply '
          f"with mutable=['{STATS}']."
        )
      raise ValueError(
        f'{self.where}: CONVERT writes the collection {FROZEN!r}; use '
        "aqtr.flax.linen.convert (or apply with mutable=['aqtr'])."
      )
    return self.module.variables.get(STATS)

  def calib_state(self, make):
    m = self.module
    fresh = make() if self.initializing else None  # Traced once, at init.

    def made():
      nonlocal fresh
      if fresh is None:
        fresh = make()
      return fresh

    if m.has_variable(common.STATE, 'stats'):
      stats = m.get_variable(common.STATE, 'stats')
    else:
      shapes = fresh or jax.eval_shape(make)
      if not jax.tree.leaves(shapes[0]):
        stats = shapes[0]  # Only learned parameters: no stats to keep.
      elif self.initializing or m.is_mutable_collection(common.STATE):
        stats = m.variable(common.STATE, 'stats', lambda: made()[0]).value
      else:
        raise ValueError(
          f'{self.where}: the config has stateful calibrations; their '
          f'state lives in the collection {common.STATE!r}: create it '
          f'with init and pass it to apply (mutable=[{common.STATE!r}] '
          'in TRAIN and CALIBRATE).'
        )
    learned = (
      m.param(common.LEARNED, lambda _: made()[1]) if make.learns else {}
    )
    return common.assemble(stats, learned)

  def store(self, result):
    for side, value in (result.stats or {}).items():
      self.module.put_variable(STATS, side, value)
    stats = None if result.state is None else common.stats_of(result.state)
    if stats is not None and jax.tree.leaves(stats) and not self.initializing:
      if self.mode in (Mode.TRAIN, Mode.CALIBRATE):
        if not self.module.is_mutable_collection(common.STATE):
          raise ValueError(
            f'{self.where}: {self.mode.name} updates the calibration state '
            f'in the collection {common.STATE!r}: apply with '
            f"mutable=['{common.STATE}'] (and merge the backward passes' "
            'state with aqtr.state.merge_tree).'
          )
        self.module.put_variable(common.STATE, 'stats', stats)
    if result.frozen is not None:
      name = lifecycle.entry_name(self.config)
      self.module.put_variable(FROZEN, name, result.frozen)

  def mark_removable(self, rhs_shape):
    # An empty [size, 0] array: its static shape holds the size, so this
    # works under eval_shape, and it costs no bytes.
    if self.module.is_mutable_collection(PLAN):
      empty = jnp.zeros((math.prod(rhs_shape), 0), jnp.int8)
      self.module.put_variable(PLAN, 'rhs_size', empty)

  def draw_key(self):
    if self.module.has_rng(self.rng_name):
      return self.module.make_rng(self.rng_name)
    return None

  def missing_key(self) -> str:
    return self._missing


class _Op(nn.Module):
  """Shared fields of the linen ops.

  Attributes:
    config: the DotGeneralConfig; None is the plain lax/jnp op.
    mode: an aqtr.Mode.
    rng_name: the rng stream of stochastic rounding.
  """

  config: DotGeneralConfig | None = None
  mode: Mode = Mode.TRAIN
  rng_name: str = common.RNG

  def _host(self) -> LinenOpHost:
    return LinenOpHost(self, self.config, self.mode, self.rng_name)


class DotGeneral(_Op):
  """`lax.dot_general` for `nn.Dense` / `nn.DenseGeneral(dot_general_cls=)`.

  The layer's kernel is the dot's rhs, so `config.fwd.rhs` quantizes (and
  freezes) the weights and `config.fwd.lhs` the activations.

  Example:
    >>> import functools, jax, jax.numpy as jnp, flax.linen as nn, aqtr
    >>> dg = functools.partial(DotGeneral, config=aqtr.presets.int8())
    >>> layer = nn.Dense(3, dot_general_cls=dg)
    >>> v = layer.init(jax.random.key(0), jnp.ones((2, 4)))
    >>> layer.apply(v, jnp.ones((2, 4))).shape
    (2, 3)
  """

  @nn.compact
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
      self._host(),
      lhs,
      rhs,
      dimension_numbers,
      precision,
      preferred_element_type,
      out_sharding,
    )


class Einsum(_Op):
  """Two-operand `jnp.einsum` (for `EinsumDense(einsum_cls=)`).

  Letters summed out of a single operand are not supported (the einsum must
  be one dot_general, so it can be frozen).

  Example:
    >>> import jax, jax.numpy as jnp, aqtr
    >>> op = Einsum(config=aqtr.presets.int8())
    >>> x, w = jnp.ones((2, 3, 4)), jnp.ones((4, 5))
    >>> op.apply({}, 'btd,df->btf', x, w).shape
    (2, 3, 5)
  """

  @nn.compact
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
      self._host(),
      subscripts,
      lhs,
      rhs,
      precision,
      preferred_element_type,
      out_sharding,
    )


class ConvGeneralDilated(_Op):
  """`lax.conv_general_dilated` for `nn.Conv(conv_general_dilated_cls=)`.

  Runs as im2col + one quantized dot (`aqtr.conv_general_dilated`): the
  forward pass and both gradients are quantized. The frozen kernel is the
  kernel matrix [C*window, O] (per-channel scales: one per output feature).

  Example:
    >>> import functools, jax, jax.numpy as jnp, flax.linen as nn, aqtr
    >>> cv = functools.partial(ConvGeneralDilated, config=aqtr.presets.int8())
    >>> layer = nn.Conv(4, (3, 3), conv_general_dilated_cls=cv)
    >>> x = jnp.ones((1, 6, 6, 2))
    >>> v = jax.eval_shape(layer.init, jax.random.key(0), x)  # shapes only
    >>> jax.eval_shape(layer.apply, v, x).shape
    (1, 6, 6, 4)
  """

  @nn.compact
  def __call__(self, lhs, rhs, *args, **kwargs):
    """As `lax.conv_general_dilated` (see `aqtr.core.conv.ConvArgs`)."""
    return common.conv_op(self._host(), lhs, rhs, *args, **kwargs)


class EinsumDense(nn.Einsum):
  """`nn.Einsum` with an injection point: `einsum_cls` (like Dense's).

  Same parameters ('kernel', 'bias') and semantics as `nn.Einsum`; the
  einsum runs through `einsum_cls()` (e.g. a partial of `Einsum`), or
  `jnp.einsum` when None.

  Example:
    >>> import functools, jax, jax.numpy as jnp, aqtr
    >>> op = functools.partial(Einsum, config=aqtr.presets.int8())
    >>> layer = EinsumDense((4, 5), 'btd,df->btf', einsum_cls=op)
    >>> v = layer.init(jax.random.key(0), jnp.ones((2, 3, 4)))
    >>> layer.apply(v, jnp.ones((2, 3, 4))).shape
    (2, 3, 5)
  """

  einsum_cls: Any = None

  @nn.compact
  def __call__(self, inputs, einsum_str: str | None = None):
    einsum_str = nn.module.merge_param(
      'einsum_str', self.einsum_str, einsum_str
    )
    einsum_str = einsum_str.replace(' ', '')
    if '->' not in einsum_str or einsum_str.count(',') != 1:
      raise ValueError(
        f'einsum_str {einsum_str!r} must be explicit ("->") with exactly two '
        'operands.'
      )
    kernel = self.param(
      'kernel', self.kernel_init, self.shape, self.param_dtype
    )
    bias = None
    if self.use_bias:
      bias_shape, bshape = self._get_bias_shape(einsum_str, inputs, kernel)
      bias = self.param('bias', self.bias_init, bias_shape, self.param_dtype)
    inputs, kernel, bias = self.promote_dtype(
      inputs, kernel, bias, dtype=self.dtype
    )
    op = self.einsum_cls() if self.einsum_cls is not None else jnp.einsum
    y = op(
      einsum_str,
      inputs,
      kernel,
      precision=self.precision,
      preferred_element_type=self.preferred_element_type,
    )
    if bias is not None:
      y += jnp.reshape(bias, bshape)
    return y


__all__ = [
  'FROZEN',
  'LEARNED',
  'STATE',
  'STATS',
  'ConvGeneralDilated',
  'DotGeneral',
  'Einsum',
  'EinsumDense',
  'LinenOpHost',
  'Mode',
  'convert',
]
