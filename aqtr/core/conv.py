"""Quantized `conv_general_dilated`: im2col onto the quantized dot_general.

Math. A convolution is one dot after extracting patches (im2col). With the
input brought to [N, C, S...] (lhs_spec order), padded (explicit pads,
interior padding for lhs dilation), and a window of W = prod(window) taps,

  P[n, s..., c*W + w] = X_pad[n, c, s * stride + w * rhs_dilation]
  K[c*W + w, o]       = kernel[o, c, w]          (rhs_spec order)
  out[n, s..., o]     = sum_k P[n, s..., k] K[k, o]

i.e. `dot_general(P, K)` contracting the patch axis; with
`feature_group_count = G` the channels split into groups that become a
batch axis of the dot: P [N, S..., G, Cg*W], K [G, Cg*W, Og]. Patches are
taken with pad + strided slices (exact, no float arithmetic), so the
forward dot and both backward dots (dX = col2im(g . K^T), dK = P^T . g) run
through the one custom VJP of `aqtr.core.dot_general` and are quantized by
`config.fwd` / `config.dlhs` / `config.drhs`. The col2im of the backward
pass is the (float, exact) transpose of the slicing.

Per-channel scales of the patch matrix are one per output position (and
group); of the kernel matrix, one per output feature.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from aqtr.core import prims
from aqtr.core.config import DotGeneralConfig
from aqtr.core.dot_general import dot_general
from aqtr.core.sharding import check_out_sharding, constrain


@dataclasses.dataclass(frozen=True)
class ConvPlan:
  """A convolution as one dot_general (static shapes only).

  Attributes:
    lhs_shape, rhs_shape: the convolution operands' shapes.
    dnums: lax.ConvDimensionNumbers (lhs_spec, rhs_spec, out_spec).
    strides, pads, lhs_dilation, rhs_dilation: per spatial axis, resolved.
    groups: feature_group_count.
  """

  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  dnums: lax.ConvDimensionNumbers
  strides: tuple[int, ...]
  pads: tuple[tuple[int, int], ...]
  lhs_dilation: tuple[int, ...]
  rhs_dilation: tuple[int, ...]
  groups: int = 1

  @property
  def window(self) -> tuple[int, ...]:
    return tuple(self.rhs_shape[a] for a in self.dnums.rhs_spec[2:])

  @property
  def out_spatial(self) -> tuple[int, ...]:
    out = []
    for i, a in enumerate(self.dnums.lhs_spec[2:]):
      size = (self.lhs_shape[a] - 1) * self.lhs_dilation[i] + 1
      size += sum(self.pads[i])
      span = (self.window[i] - 1) * self.rhs_dilation[i] + 1
      out.append(max(0, (size - span) // self.strides[i] + 1))
    return tuple(out)

  @property
  def dimension_numbers(self):
    """The dot's dimension numbers: patch axis . kernel axis (per group)."""
    nd = 1 + len(self.window) + (1 if self.groups > 1 else 0)
    if self.groups == 1:
      return ((nd,), (0,)), ((), ())
    return ((nd,), (1,)), ((nd - 1,), (0,))

  @property
  def kernel_shape(self) -> tuple[int, ...]:
    """Shape of the kernel matrix (the dot's rhs)."""
    c_in = self.rhs_shape[self.dnums.rhs_spec[1]]
    c_out = self.rhs_shape[self.dnums.rhs_spec[0]]
    k = c_in * math.prod(self.window)
    if self.groups == 1:
      return (k, c_out)
    return (self.groups, k, c_out // self.groups)

  def patches(self, lhs: jax.Array) -> jax.Array:
    """[N, S_out..., C*W] (or [N, S_out..., G, Cg*W]): the dot's lhs."""
    x = lhs.transpose(self.dnums.lhs_spec)  # [N, C, S...]
    cfg = [(0, 0, 0), (0, 0, 0)] + [
      (lo, hi, d - 1)
      for (lo, hi), d in zip(self.pads, self.lhs_dilation, strict=True)
    ]
    x = lax.pad(x, jnp.zeros((), x.dtype), cfg)
    n, c = x.shape[:2]
    outs = self.out_spatial
    taps = []
    for offs in itertools.product(*(range(k) for k in self.window)):
      start = [0, 0] + [
        o * r for o, r in zip(offs, self.rhs_dilation, strict=True)
      ]
      limit = [n, c] + [
        s + (m - 1) * st + 1
        for s, m, st in zip(start[2:], outs, self.strides, strict=True)
      ]
      taps.append(lax.slice(x, start, limit, (1, 1) + self.strides))
    p = jnp.stack(taps, axis=2)  # [N, C, W, S_out...]
    nsp = len(outs)
    p = p.transpose((0,) + tuple(range(3, 3 + nsp)) + (1, 2))
    w = len(taps)
    if self.groups == 1:
      return p.reshape((n,) + outs + (c * w,))
    g = self.groups
    return p.reshape((n,) + outs + (g, c // g * w))

  def kernel(self, rhs: jax.Array) -> jax.Array:
    """The kernel matrix [C*W, O] (or [G, Cg*W, Og]): the dot's rhs."""
    o_ax, i_ax = self.dnums.rhs_spec[:2]
    k = rhs.transpose((i_ax,) + tuple(self.dnums.rhs_spec[2:]) + (o_ax,))
    if self.groups == 1:
      return k.reshape(self.kernel_shape)
    g, kk, og = self.kernel_shape
    return k.reshape(kk, g, og).transpose(1, 0, 2)

  def output(self, out: jax.Array) -> jax.Array:
    """The dot's output -> the convolution's output layout (out_spec)."""
    nsp = len(self.out_spatial)
    if self.groups > 1:  # [G, N, S..., Og] -> [N, S..., G*Og]
      out = jnp.moveaxis(out, 0, -2)
      out = out.reshape(out.shape[:-2] + (-1,))
    # `out` is [N, S..., O]; out_spec says where N, O, S_i go.
    src = (0, nsp + 1) + tuple(range(1, nsp + 1))
    perm = [0] * (nsp + 2)
    for role, axis in enumerate(self.dnums.out_spec):
      perm[axis] = src[role]
    return out.transpose(perm)


def _tuple(v, n: int, name: str, default: int = 1) -> tuple[int, ...]:
  if v is None:
    return (default,) * n
  v = tuple(int(a) for a in v)
  if len(v) != n:
    raise ValueError(
      f'{name} must have one entry per spatial axis ({n}), got {v}.'
    )
  return v


def plan(lhs_shape, rhs_shape, *args, **kwargs) -> ConvPlan:
  """The `ConvPlan` of a convolution: lax's arguments after the operands
  (`ConvArgs`), resolved for the operand shapes (lax semantics).

  Example:
    >>> p = plan((2, 8, 8, 3), (3, 3, 3, 4), (1, 1), 'SAME',
    ...          dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
    >>> p.kernel_shape, p.out_spatial
    ((27, 4), (8, 8))
  """
  return ConvArgs.bind(*args, **kwargs).plan(lhs_shape, rhs_shape)


def _resolve(lhs_shape, rhs_shape, a: ConvArgs) -> ConvPlan:
  """Resolves a convolution's arguments into a `ConvPlan` (lax semantics)."""
  window_strides, padding = a.window_strides, a.padding
  lhs_dilation, rhs_dilation = a.lhs_dilation, a.rhs_dilation
  dimension_numbers = a.dimension_numbers
  feature_group_count = a.feature_group_count
  batch_group_count = a.batch_group_count
  lhs_shape, rhs_shape = tuple(lhs_shape), tuple(rhs_shape)
  if batch_group_count != 1:
    raise NotImplementedError(
      'aqtr.conv_general_dilated: batch_group_count must be 1 (got '
      f'{batch_group_count}); use config=None for lax.'
    )
  dn = lax.conv_dimension_numbers(lhs_shape, rhs_shape, dimension_numbers)
  nsp = len(lhs_shape) - 2
  strides = _tuple(window_strides, nsp, 'window_strides')
  lhs_d = _tuple(lhs_dilation, nsp, 'lhs_dilation')
  rhs_d = _tuple(rhs_dilation, nsp, 'rhs_dilation')
  g = int(feature_group_count)
  c_in = lhs_shape[dn.lhs_spec[1]]
  c_out = rhs_shape[dn.rhs_spec[0]]
  if g < 1 or c_in % g or c_out % g or rhs_shape[dn.rhs_spec[1]] * g != c_in:
    raise ValueError(
      f'feature_group_count={g} must divide the input features ({c_in}) and '
      f'output features ({c_out}), with kernel input features = {c_in}/{g}.'
    )
  if isinstance(padding, str):
    if any(d != 1 for d in lhs_d):
      raise ValueError(
        'String padding is not implemented with lhs_dilation (transposed '
        'convolution); give explicit (low, high) pads.'
      )
    window = [rhs_shape[a] for a in dn.rhs_spec[2:]]
    eff = [(k - 1) * r + 1 for k, r in zip(window, rhs_d, strict=True)]
    pads = lax.padtype_to_pads(
      [lhs_shape[a] for a in dn.lhs_spec[2:]], eff, strides, padding
    )
  else:
    pads = padding
  try:
    pads = tuple((int(lo), int(hi)) for lo, hi in pads)
  except (TypeError, ValueError):
    raise ValueError(
      "padding must be 'SAME', 'SAME_LOWER', 'VALID' or a sequence of "
      f'(low, high) pairs, got {padding!r}.'
    ) from None
  if len(pads) != nsp:
    raise ValueError(f'padding needs {nsp} (low, high) pairs, got {pads}.')
  return ConvPlan(lhs_shape, rhs_shape, dn, strides, pads, lhs_d, rhs_d, g)


@dataclasses.dataclass(frozen=True)
class ConvArgs:
  """The arguments of `lax.conv_general_dilated` after its two operands.

  One pack for the quantized conv and the adapters' conv ops, which take
  lax's signature and forward it here unchanged.

  Example:
    >>> ConvArgs.bind((1, 1), 'SAME', feature_group_count=2).padding
    'SAME'
  """

  window_strides: Any
  padding: Any
  lhs_dilation: Any = None
  rhs_dilation: Any = None
  dimension_numbers: Any = None
  feature_group_count: int = 1
  batch_group_count: int = 1
  precision: Any = None
  preferred_element_type: Any = None
  out_sharding: Any = None

  @classmethod
  def bind(cls, *args, **kwargs) -> ConvArgs:
    """The pack from lax's positional / keyword arguments after lhs, rhs."""
    return cls(*args, **kwargs)

  def plan(self, lhs_shape, rhs_shape) -> ConvPlan:
    """The `ConvPlan` of these arguments for the given operand shapes."""
    return _resolve(lhs_shape, rhs_shape, self)

  def lax(self, lhs, rhs) -> jax.Array:
    """`lax.conv_general_dilated(lhs, rhs, *these arguments)` (float)."""
    return prims.conv_general_dilated(
      lhs,
      rhs,
      self.window_strides,
      self.padding,
      self.lhs_dilation,
      self.rhs_dilation,
      self.dimension_numbers,
      self.feature_group_count,
      self.batch_group_count,
      self.precision,
      self.preferred_element_type,
      out_sharding=self.out_sharding,
    )


def conv_general_dilated(
  lhs: jax.Array,
  rhs: jax.Array,
  window_strides,
  padding,
  lhs_dilation=None,
  rhs_dilation=None,
  dimension_numbers=None,
  feature_group_count: int = 1,
  batch_group_count: int = 1,
  precision=None,
  preferred_element_type=None,
  out_sharding=None,
  *,
  config: DotGeneralConfig | None = None,
  key: jax.Array | None = None,
) -> jax.Array:
  """Drop-in for `lax.conv_general_dilated`, quantized as `config` says.

  The convolution runs as one `aqtr.dot_general` on im2col patches (see the
  module docstring), so the forward and both gradients are quantized by the
  same config and custom VJP. `config=None` (or an all-float config) is
  exactly `lax.conv_general_dilated`.

  Args:
    lhs, rhs: input and kernel, as in lax. (To serve a frozen kernel, use
      `plan(...)`: `.patches`, `.kernel`, `.output` around `dot_general`,
      whose rhs may be a QTensor of the kernel matrix.)
    window_strides, padding, lhs_dilation, rhs_dilation: as in lax.
    dimension_numbers, feature_group_count, precision: as in lax.
    preferred_element_type: as in lax.
    batch_group_count: must be 1 when quantized.
    out_sharding: passed to lax on the float path; otherwise the output is
      resharded to it (explicit axes) or constrained (auto axes).
    config: a DotGeneralConfig (its lhs is the patches, its rhs the kernel).
    key: PRNG key for stochastic rounding.

  Returns:
    The convolution output in `dimension_numbers`' out_spec layout.

  Example:
    >>> import jax.numpy as jnp, aqtr
    >>> x, k = jnp.ones((1, 4, 4, 2)), jnp.ones((3, 3, 2, 5))
    >>> y = aqtr.conv_general_dilated(
    ...   x, k, (1, 1), 'SAME', dimension_numbers=('NHWC', 'HWIO', 'NHWC'),
    ...   config=aqtr.presets.int8())
    >>> y.shape, float(y[0, 1, 1, 0])
    ((1, 4, 4, 5), 18.0)
  """
  check_out_sharding(out_sharding, jnp.ndim(lhs), 'conv: the rank of lhs')
  args = ConvArgs(
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

  def dot(patches, kernel, dn, precision, preferred_element_type):
    return dot_general(
      patches,
      kernel,
      dn,
      config,
      key=key,
      precision=precision,
      preferred_element_type=preferred_element_type,
    )

  return conv_via(dot, config is None or config.is_float, lhs, rhs, args)


def conv_via(
  dot: Callable, is_float: bool, lhs, rhs, args: ConvArgs
) -> jax.Array:
  """A convolution whose patch x kernel product is `dot(...)`.

  The shared body of `conv_general_dilated` and the adapters' conv ops
  (which pass their own dot, e.g. one reading a frozen kernel). With
  `is_float` it is exactly `lax.conv_general_dilated`.

  Args:
    dot: `(patches, kernel, dimension_numbers, precision,
      preferred_element_type) -> out`.
    is_float: take lax's float convolution instead.
    lhs, rhs: as in `lax.conv_general_dilated`.
    args: the rest of lax's arguments (`ConvArgs`).

  Returns:
    The convolution output in `dimension_numbers`' out_spec layout.
  """
  if is_float:
    return args.lax(lhs, rhs)
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  p = args.plan(lhs.shape, rhs.shape)
  out = p.output(
    dot(
      p.patches(lhs),
      p.kernel(rhs),
      p.dimension_numbers,
      args.precision,
      args.preferred_element_type,
    )
  )
  return constrain(out, args.out_sharding)


__all__ = ['ConvArgs', 'ConvPlan', 'conv_general_dilated', 'conv_via', 'plan']
