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

`convert` returns serving variables in which each frozen float kernel is a
`Removed` placeholder (no array; it reads as zeros of its shape, which XLA
drops under jit): the serving tree holds int8/int4 qvalues and scales only.

Stochastic rounding draws keys from the rng stream `rng_name` ('quant'),
needed only when the config rounds stochastically (the backward passes only
in TRAIN).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from aqtr.core import conv as conv_lib
from aqtr.core.config import DotGeneralConfig
from aqtr.flax import common
from aqtr.flax.linen_convert import (
  FROZEN,
  HOW_CALIBRATE,
  HOW_CONVERT,
  STATS,
  Removed,
  convert,
  report,
)
from aqtr.freezers import Mode, lifecycle


class _Op(nn.Module):
  """Shared fields and the mode machinery of the linen ops.

  Attributes:
    config: the DotGeneralConfig; None is the plain lax/jnp op.
    mode: an aqtr.Mode.
    rng_name: the rng stream of stochastic rounding.
  """

  config: DotGeneralConfig | None = None
  mode: Mode = Mode.TRAIN
  rng_name: str = common.RNG

  def _where(self) -> str:
    return f'{type(self).__name__} at /{"/".join(map(str, self.path))}'

  def _key(self, cfg: DotGeneralConfig, mode: Mode):
    use = lifecycle.key_use(cfg, mode)
    if use is None:
      return None
    if self.has_rng(self.rng_name):
      return self.make_rng(self.rng_name)
    if use == 'dummy' or self.is_initializing():
      return jax.random.key(0)
    raise ValueError(
      f'{self._where()}: the config rounds stochastically and needs the '
      f'PRNG stream {self.rng_name!r}: pass rngs={{{self.rng_name!r}: '
      'key}} to apply.'
    )

  def _dot(self, lhs, rhs, dn, precision, preferred):
    cfg = self.config
    lifecycle.validate(cfg)
    common.check_mode(self.mode)
    mode, init = self.mode, self.is_initializing()
    fz = lifecycle.freezers(cfg)
    frozen = stats = None
    if fz and not init:
      if mode is Mode.SERVE:
        frozen = lifecycle.find_frozen(
          self.variables.get(FROZEN),
          cfg,
          self._where(),
          FROZEN,
          HOW_CONVERT,
        )
      elif mode is Mode.CALIBRATE:
        if not self.is_mutable_collection(STATS):
          raise ValueError(
            f'{self._where()}: CALIBRATE updates the collection {STATS!r}; '
            f"apply with mutable=['{STATS}']."
          )
        stats = self.variables.get(STATS)
      elif mode is Mode.CONVERT:
        if not self.is_mutable_collection(FROZEN):
          raise ValueError(
            f'{self._where()}: CONVERT writes the collection {FROZEN!r}; use '
            "aqtr.flax.linen.convert (or apply with mutable=['aqtr'])."
          )
        stats = self.variables.get(STATS)
    r = lifecycle.run(
      mode,
      lhs,
      rhs,
      dn,
      cfg,
      frozen=frozen,
      stats=stats,
      key=self._key(cfg, mode),
      precision=precision,
      preferred_element_type=preferred,
      initializing=init,
      where=self._where(),
      how_stats=HOW_CALIBRATE,
    )
    for side, value in (r.stats or {}).items():
      self.put_variable(STATS, side, value)
    if r.frozen is not None:
      self.put_variable(FROZEN, lifecycle.entry_name(cfg), r.frozen)
    return r.out


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
    if common.is_float(self.config):
      return lax.dot_general(
        lhs,
        rhs,
        dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding,
      )
    out = self._dot(
      lhs, rhs, dimension_numbers, precision, preferred_element_type
    )
    return common.constrain(out, out_sharding)


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
    if common.is_float(self.config):
      return jnp.einsum(
        subscripts,
        lhs,
        rhs,
        precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding,
      )
    dn, perm = common.einsum_plan(subscripts, jnp.ndim(lhs), jnp.ndim(rhs))
    out = self._dot(lhs, rhs, dn, precision, preferred_element_type)
    if perm is not None:
      out = out.transpose(perm)
    return common.constrain(out, out_sharding)


class ConvGeneralDilated(_Op):
  """`lax.conv_general_dilated` for `nn.Conv(conv_general_dilated_cls=)`.

  Runs as im2col + one quantized dot (`aqtr.conv_general_dilated`): the
  forward pass and both gradients are quantized. The frozen kernel is the
  kernel matrix [C*window, O] (per-channel scales: one per output feature).

  Example:
    >>> import functools, jax, jax.numpy as jnp, flax.linen as nn, aqtr
    >>> cv = functools.partial(ConvGeneralDilated, config=aqtr.presets.int8())
    >>> layer = nn.Conv(4, (3, 3), conv_general_dilated_cls=cv)
    >>> v = layer.init(jax.random.key(0), jnp.ones((1, 6, 6, 2)))
    >>> layer.apply(v, jnp.ones((1, 6, 6, 2))).shape
    (1, 6, 6, 4)
  """

  @nn.compact
  def __call__(
    self,
    lhs,
    rhs,
    window_strides,
    padding,
    lhs_dilation=None,
    rhs_dilation=None,
    dimension_numbers=None,
    feature_group_count=1,
    batch_group_count=1,
    precision=None,
    preferred_element_type=None,
    out_sharding=None,
  ):
    return conv_lib.conv_via(
      self._dot,
      common.is_float(self.config),
      lhs,
      rhs,
      window_strides,
      padding,
      lhs_dilation,
      rhs_dilation,
      dimension_numbers,
      feature_group_count,
      batch_group_count,
      precision,
      preferred_element_type,
      out_sharding,
    )


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
  'STATS',
  'ConvGeneralDilated',
  'DotGeneral',
  'Einsum',
  'EinsumDense',
  'Mode',
  'Removed',
  'convert',
  'report',
]
