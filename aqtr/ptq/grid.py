"""One weight's quantization grid, as the engine computes it, as matrices.

The solvers work on the weight as a matrix `w2 = as_matrix(w) [d_in,
d_out]`; serving reads the frozen parts {qvalue, scale[, zero_point]} in
the dot's tiled view (`aqtr.freezers.weights`). `Grid.of(site, w)` runs
the engine's own forward quantization of the weight (the rule's numerics,
calibration and tiling: `OperandCall.quantize`, what CONVERT stores) and
keeps its scales; `grid.quantize(w2)` then rounds ANY weight matrix to
that fixed grid with the numerics' own `quantize`, elementwise:

  v = w / s (* unit) + z,   q = numerics.quantize(v),   w^ = (q - z) s

(exactly `aqtr.core.quantizer.quantize_view` with the scale given), and
`grid.parts(q2)` lays a matrix of q-values out as the frozen entry. A
registered numerics works unchanged.

Example:
  >>> import jax, jax.numpy as jnp, aqtr
  >>> from aqtr.ptq.collect import Site
  >>> w = jax.random.normal(jax.random.key(0), (8, 4))
  >>> s = Site('op', (((1,), (0,)), ((), ())),
  ...          aqtr.presets.int8_weight_only(),
  ...          jax.ShapeDtypeStruct((2, 8), jnp.float32),
  ...          jax.ShapeDtypeStruct((8, 4), jnp.float32))
  >>> g = Grid.of(s, w)
  >>> q, wq = g.quantize(g.w2)
  >>> bool((g.parts(q)['qvalue'] == g.rtn['qvalue']).all())
  True
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from aqtr.core import slot_state
from aqtr.core.qtensor import QTensor, to_view
from aqtr.core.scale import divide
from aqtr.freezers import configure, lifecycle


def weight_config(config):
  """The op's config with the 'weights' freezer on its rhs (what CONVERT
  of a rules model or a Pax serving template uses)."""
  return configure(config, rhs='weights')


def check_config(config, where: str, solver: str) -> None:
  """Raises one line when `solver` cannot solve the op's weight config."""
  rhs = config.fwd.rhs
  bad = None
  if not rhs.quantized:
    bad = 'its weight (rhs) is not quantized (activation-only config)'
  elif rhs.rounding.stochastic:
    bad = 'its weight rounds stochastically (use round-to-nearest)'
  elif slot_state.paths(config):
    bad = 'it has a stateful calibration (its scales are learned state)'
  elif rhs.rotated:
    bad = 'its weight is rotated by a transform'
  elif rhs.sparse:
    bad = 'its weight is sparsified'
  if bad:
    raise ValueError(
      f'aqtr.ptq: {solver} cannot solve {where}: {bad}; exclude it with a '
      'rule or change its config.'
    )


@dataclasses.dataclass(frozen=True)
class Grid:
  """The fixed quantization grid of one weight (see the module docstring).

  Attributes:
    w2: the float weight as [d_in, d_out] (float32).
    scale2, zero2: the per-element scale and zero point as [d_in, d_out].
    rtn: the engine's frozen parts of the weight (round to nearest).
    numerics: the rule's numerics.
    call: the engine's view of the weight operand (`OperandCall`; shapes
      only).
  """

  w2: jax.Array
  scale2: jax.Array
  zero2: jax.Array
  rtn: dict
  numerics: object
  call: lifecycle.OperandCall

  @classmethod
  def of(cls, site, w: jax.Array) -> Grid:
    """The engine's grid of weight `w` of op `site` (a `collect.Site`)."""
    w = jnp.asarray(w)
    call = _call(site, jax.ShapeDtypeStruct(w.shape, w.dtype))
    parts = _engine(site, w)
    view, to2 = _maps(site, w.shape)
    zero = parts.get('zero_point', np.zeros((), np.float32))

    def matrix(a):
      return jnp.asarray(to2.from_view(np.broadcast_to(np.asarray(a), view)))

    return cls(
      jnp.asarray(to2.from_weight(np.asarray(w, np.float32))),
      matrix(parts['scale']),
      matrix(zero),
      parts,
      site.config.fwd.rhs.numerics,
      call,
    )

  def quantize(self, w2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(q-values, dequantized) of `w2` [d_in, d_out] on the grid."""
    return quantize_fixed(self.numerics, w2, self.scale2, self.zero2)

  def parts(self, q2: jax.Array) -> dict:
    """The frozen entry's rhs parts holding q-values `q2` [d_in, d_out]."""
    shape = tuple(self.call.x.shape)
    view, to2 = _maps_of(self.call, self.contracting, shape)
    flat = np.empty(int(np.prod(shape)), np.float32)
    flat[to2.index] = np.asarray(q2, np.float32).ravel()
    q4 = flat[to2.view_index].reshape(view)
    out = dict(self.rtn)
    out['qvalue'] = jnp.asarray(q4).astype(self.rtn['qvalue'].dtype)
    return out

  @property
  def contracting(self) -> tuple[int, ...]:
    return tuple(self.call.call.dimension_numbers[0][1])

  def dequant(self, parts: dict) -> jax.Array:
    """The weight the frozen `parts` serve, as [d_in, d_out]."""
    qt = QTensor(
      parts['qvalue'],
      parts['scale'],
      self.call.layout,
      self.call.form,
      parts.get('zero_point'),
    )
    w = np.asarray(_dequant(qt))
    _, to2 = _maps_of(self.call, self.contracting, w.shape)
    return jnp.asarray(to2.from_weight(w))


@functools.partial(jax.jit, static_argnums=0)
def quantize_fixed(numerics, w2, s, z) -> tuple[jax.Array, jax.Array]:
  """(q, (q - z) s) of `w2` with the fixed scale `s` and zero point `z`."""
  v = divide(w2.astype(jnp.float32), s, numerics.unit) + z
  q = numerics.quantize(v, None).astype(jnp.float32)
  return q, (q - z) * s


@jax.jit
def _dequant(qt: QTensor) -> jax.Array:
  return qt.dequant()


def _call(site, w):
  cfg = weight_config(site.config)
  return lifecycle.DotCall(site.lhs, w, site.dimension_numbers, cfg).operand(
    'rhs'
  )


def _engine(site, w) -> dict:
  """The engine's frozen parts of `w` (RTN: what CONVERT stores)."""
  dn = site.dimension_numbers
  return _engine_jit(dn, site.config, site.lhs, w)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _engine_jit(dn, config, lhs, w) -> dict:
  zeros = jnp.zeros(lhs.shape, lhs.dtype)
  call = lifecycle.DotCall(zeros, w, dn, weight_config(config))
  qt = call.operand('rhs').quantize()
  parts = {'qvalue': qt.qvalue, 'scale': qt.scale}
  if qt.zero_point is not None:  # Affine numerics.
    parts['zero_point'] = qt.zero_point
  return parts


class _ToMatrix:
  """Host index maps between a weight, its tiled view and its matrix.

  Attributes:
    view_index: for each view element, its flat index in the weight.
    index: for each matrix element, its flat index in the weight.
    shape: the matrix shape [d_in, d_out].
  """

  def __init__(self, view_index: np.ndarray, index: np.ndarray, shape):
    self.view_index, self.index, self.shape = view_index, index, shape

  def from_weight(self, w) -> np.ndarray:
    return np.asarray(w).ravel()[self.index].reshape(self.shape)

  def from_view(self, a4) -> np.ndarray:
    flat = np.empty(self.view_index.size, np.asarray(a4).dtype)
    flat[self.view_index] = np.asarray(a4).ravel()
    return flat[self.index].reshape(self.shape)


def _maps(site, shape):
  call = _call(site, jax.ShapeDtypeStruct(tuple(shape), jnp.float32))
  return _maps_of(call, site.contracting, tuple(shape))


@functools.lru_cache(maxsize=64)
def _cached(layout, form, tile, contracting, shape):
  n = int(np.prod(shape))
  idx = np.arange(n).reshape(shape)
  x3 = layout.to_canonical(idx, form)  # numpy in, numpy out
  view_index = np.asarray(to_view(x3, form, tile)).ravel()
  dims = tuple(sorted(d % len(shape) for d in contracting))
  rest = tuple(d for d in range(len(shape)) if d not in dims)
  d_in = int(np.prod([shape[d] for d in dims]))
  m = np.transpose(idx, dims + rest).reshape(d_in, -1)
  view = np.asarray(to_view(x3, form, tile)).shape
  return view, _ToMatrix(view_index, m.ravel(), m.shape)


def _maps_of(call, contracting, shape):
  """(view shape, _ToMatrix) of an operand call (cached by layout)."""
  return _cached(call.layout, call.form, call.tile, tuple(contracting), shape)


__all__ = ['Grid', 'check_config', 'quantize_fixed', 'weight_config']
