"""Injectable contraction ops: the one seam between layers and quantization.

Every tensor contraction of an `aqtr.pax` layer goes through an op module
held in a field of the layer (`Linear.einsum`, `Attention.qk_einsum`, ...).
An op has no parameters; its `config` decides the arithmetic:

  config=None                  float (`jnp.einsum` / `lax.dot_general` /
                               `lax.conv_general_dilated` exactly)
  config=DotGeneralConfig(...) quantized by `aqtr.einsum` / `dot_general` /
                               `conv_general_dilated`

so quantizing a model means setting `config` on op nodes of its Fiddle
config (`aqtr.pax.inject`), and the parameter tree never changes. A field
left unset (None) is the float op.

Stochastic rounding needs a PRNG key: an op whose config asks for it draws
one from the linen rng stream `rng_stream` (default 'quant'), so apply the
model with `rngs={'quant': key}`. Ops without stochastic rounding never
touch the stream.

Example:
  >>> import jax, jax.numpy as jnp, aqtr
  >>> op = EinsumOp(config=aqtr.presets.int8())
  >>> x, w = jnp.ones((2, 8)), jnp.ones((8, 3))
  >>> op.apply({}, 'md,df->mf', x, w).shape
  (2, 3)
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

import aqtr
from aqtr.core import slot_state
from aqtr.core.config import DotGeneralConfig, TensorConfig
from aqtr.flax import common, intercept, linen_convert
from aqtr.flax.linen import LinenOpHost
from aqtr.flax.sites import WeightSite
from aqtr.freezers import Mode

__all__ = [
  'ConvOp',
  'DotGeneralOp',
  'EinsumOp',
  'Op',
  'RaggedDotOp',
  'conv',
  'einsum',
  'needs_key',
  'op_fields',
  'ragged_dot',
]


def needs_key(config: Any) -> bool:
  """Whether `config` quantizes some operand with stochastic rounding.

  Walks any tree of frozen dataclasses (DotGeneralConfig or a future conv
  config) looking for a quantized TensorConfig with stochastic rounding.

  Args:
    config: a config dataclass, or None.

  Returns:
    True when applying the op needs a PRNG key.

  Example:
    >>> import aqtr
    >>> needs_key(aqtr.presets.int8())
    False
    >>> needs_key(aqtr.presets.fully_quantized(8, 8, True))
    True
  """
  if isinstance(config, TensorConfig):
    return config.quantized and config.rounding.stochastic
  if dataclasses.is_dataclass(config) and not isinstance(config, type):
    return any(
      needs_key(getattr(config, f.name)) for f in dataclasses.fields(config)
    )
  return False


def _is_float(config: Any) -> bool:
  return config is None or (
    isinstance(config, DotGeneralConfig) and config.is_float
  )


class Op(nn.Module):
  """Base of the injectable ops (no parameters, only a config).

  Attributes:
    config: a DotGeneralConfig, or None for the float op.
    rng_stream: linen rng stream of the stochastic-rounding key.
    mode: an aqtr.Mode. TRAIN quantizes on the fly; the other modes run
      the op's freezers (`aqtr.freezers.configure`) exactly as the
      `aqtr.flax.linen` ops do: CALIBRATE updates 'aqtr_stats', CONVERT
      writes 'aqtr' (use `aqtr.flax.linen.convert`), SERVE reads it.
  """

  config: DotGeneralConfig | None = None
  rng_stream: str = 'quant'
  mode: Mode = Mode.TRAIN

  def _host(self) -> LinenOpHost:
    s = self.rng_stream
    return LinenOpHost(
      self,
      self.config,
      self.mode,
      s,
      where='/'.join(self.path) or type(self).__name__,
      missing_key=(
        f'a PRNG key from the rng stream {s!r}; apply the model with '
        f"rngs={{'{s}': jax.random.key(step)}}."
      ),
    )

  def _key(self) -> jax.Array | None:
    """TRAIN's key: required whenever the config rounds stochastically."""
    if not needs_key(self.config):
      return None
    host = self._host()
    key = host.draw_key()
    if key is None:
      raise ValueError(
        f'{host.where}: its config uses stochastic rounding and needs '
        f'{host.missing_key()}'
      )
    return key

  def _weight_op(self) -> bool:
    """Whether the op quantizes its weight (rhs) in the forward pass."""
    cfg = self.config
    return isinstance(cfg, DotGeneralConfig) and cfg.fwd.rhs.quantized

  def _frozen_modes(self) -> bool:
    """Whether this call goes through the adapters' shared op body: in any
    mode but TRAIN (the freezers), and with stateful calibrations (their
    state lives in the collection 'aqtr_state')."""
    mode = linen_convert.ops_mode(self, self.mode)
    common.check_mode(mode)
    if _is_float(self.config):
      return False
    return mode is not Mode.TRAIN or bool(slot_state.paths(self.config))


class EinsumOp(Op):
  """Two-operand einsum; `aqtr.einsum(eqn, lhs, rhs, config=config)`.

  Example:
    >>> import jax.numpy as jnp
    >>> EinsumOp().apply({}, 'k,k->', jnp.ones(3), jnp.ones(3)).tolist()
    3.0
  """

  @nn.compact
  def __call__(self, eqn: str, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    return self.contract(eqn, lhs, rhs)

  def contract(self, eqn: str, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    """The op's einsum in its mode (subclasses add to it in `__call__`).

    While an observer records weight ops (`aqtr.flax.intercept.recorder`:
    the PTQ calibration pass), a weight op reports its contraction and
    runs in float.
    """
    rec = intercept.recorder()
    if rec is not None and self._weight_op() and not self.is_initializing():
      dn, _ = common.einsum_plan(eqn, jnp.ndim(lhs), jnp.ndim(rhs))
      where = '/'.join(map(str, self.path))
      site = WeightSite(
        op_path=where,
        op_module=tuple(self.path),
        kind='einsum',
        dimension_numbers=dn,
        config=self.config,
      )
      rec.record_op(site, lhs, rhs)
      with intercept.quiet():
        return jnp.einsum(eqn, lhs, rhs)
    if self._frozen_modes():
      return common.einsum_op(self._host(), eqn, lhs, rhs)
    return aqtr.einsum(eqn, lhs, rhs, config=self.config, key=self._key())


class DotGeneralOp(Op):
  """`lax.dot_general` drop-in; `aqtr.dot_general(..., config)`.

  Example:
    >>> import jax.numpy as jnp
    >>> dn = (((1,), (0,)), ((), ()))
    >>> DotGeneralOp().apply({}, jnp.ones((2, 3)), jnp.ones((3, 4)), dn).shape
    (2, 4)
  """

  @nn.compact
  def __call__(
    self,
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
  ) -> jax.Array:
    if self._frozen_modes():
      return common.dot_general_op(
        self._host(),
        lhs,
        rhs,
        dimension_numbers,
        precision,
        preferred_element_type,
      )
    return aqtr.dot_general(
      lhs,
      rhs,
      dimension_numbers,
      self.config,
      key=self._key(),
      precision=precision,
      preferred_element_type=preferred_element_type,
    )


class RaggedDotOp(Op):
  """`lax.ragged_dot` drop-in (experts); `aqtr.ragged_dot(..., config)`.

  Example:
    >>> import jax.numpy as jnp
    >>> x, w = jnp.ones((3, 4)), jnp.ones((2, 4, 5))
    >>> RaggedDotOp().apply({}, x, w, jnp.array([1, 2])).shape
    (3, 5)
  """

  def __call__(
    self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array
  ) -> jax.Array:
    return aqtr.ragged_dot(lhs, rhs, group_sizes, self.config, key=self._key())


def ragged_dot(
  op: RaggedDotOp | None,
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
) -> jax.Array:
  """Runs `op(lhs, rhs, group_sizes)`, or `lax.ragged_dot` when None.

  Example:
    >>> import jax.numpy as jnp
    >>> x, w = jnp.ones((3, 2)), jnp.ones((2, 2, 1))
    >>> ragged_dot(None, x, w, jnp.array([1, 2])).ravel().tolist()
    [2.0, 2.0, 2.0]
  """
  if op is None:
    return lax.ragged_dot(lhs, rhs, group_sizes)
  return op(lhs, rhs, group_sizes)


def einsum(op: EinsumOp | None, eqn: str, lhs: jax.Array, rhs: jax.Array):
  """Runs `op(eqn, lhs, rhs)`, or the float `jnp.einsum` when `op` is None.

  Layers call their op fields through this, so an unset field is the float
  op.

  Example:
    >>> import jax.numpy as jnp
    >>> einsum(None, 'k,k->', jnp.ones(3), jnp.ones(3)).tolist()
    3.0
  """
  if op is None:
    return jnp.einsum(eqn, lhs, rhs)
  return op(eqn, lhs, rhs)


def conv(op: ConvOp | None, lhs: jax.Array, rhs: jax.Array, *args, **kwargs):
  """Runs `op(lhs, rhs, ...)`, or `lax.conv_general_dilated` when None.

  Example:
    >>> import jax.numpy as jnp
    >>> x, k = jnp.ones((1, 3, 3, 1)), jnp.ones((3, 3, 1, 1))
    >>> conv(None, x, k, (1, 1), 'VALID',
    ...      dimension_numbers=('NHWC', 'HWIO', 'NHWC')).ravel().tolist()
    [9.0]
  """
  if op is None:
    return lax.conv_general_dilated(lhs, rhs, *args, **kwargs)
  return op(lhs, rhs, *args, **kwargs)


class ConvOp(Op):
  """`lax.conv_general_dilated` drop-in, quantized when `config` is set.

  Takes lax's arguments after `lhs, rhs` (`aqtr.core.conv.ConvArgs`).

  Example:
    >>> import jax.numpy as jnp
    >>> x, k = jnp.ones((1, 4, 4, 2)), jnp.ones((3, 3, 2, 5))
    >>> dn = ('NHWC', 'HWIO', 'NHWC')
    >>> ConvOp().apply({}, x, k, (1, 1), 'SAME', dimension_numbers=dn).shape
    (1, 4, 4, 5)
  """

  @nn.compact
  def __call__(self, lhs: jax.Array, rhs: jax.Array, *args, **kwargs):
    if self._frozen_modes():
      return common.conv_op(self._host(), lhs, rhs, *args, **kwargs)
    return aqtr.conv_general_dilated(
      lhs, rhs, *args, config=self.config, key=self._key(), **kwargs
    )


def _op_class(hint: Any) -> type[Op] | None:
  """The Op subclass named by a field annotation, if any."""
  if typing.get_origin(hint) is typing.Annotated:
    hint = typing.get_args(hint)[0]
  if typing.get_origin(hint) in (typing.Union, types.UnionType):
    found = [_op_class(h) for h in typing.get_args(hint)]
    found = [c for c in found if c is not None]
    return found[0] if len(found) == 1 else None
  if isinstance(hint, type) and issubclass(hint, Op):
    return hint
  return None


@functools.cache
def op_fields(cls: type) -> dict[str, type[Op]]:
  """The op fields of a layer class: field name -> op class.

  A field is an op field when its annotation names an `Op` subclass
  (possibly inside `Annotated[...]` and `| None`).

  Args:
    cls: a layer class (any class with type hints).

  Returns:
    Field names mapped to the op class they hold, in definition order.

  Example:
    >>> import aqtr.pax
    >>> op_fields(aqtr.pax.Attention)['qk_einsum'].__name__
    'EinsumOp'
  """
  try:
    hints = typing.get_type_hints(cls, include_extras=True)
  except Exception:  # unresolvable hints: no op fields
    return {}
  out = {}
  for name, hint in hints.items():
    op = _op_class(hint)
    if op is not None:
      out[name] = op
  return out
