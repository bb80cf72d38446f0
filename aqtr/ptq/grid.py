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

import jax
import jax.numpy as jnp
import numpy as np

from aqtr.core import slot_state
from aqtr.core.qtensor import QTensor, to_view
from aqtr.core.scale import divide
from aqtr.freezers import configure, lifecycle
from aqtr.ptq.stats import as_matrix


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
    call: the engine's view of the weight operand (`OperandCall`).
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
    cfg = weight_config(site.config)
    lhs = jnp.zeros(site.lhs.shape, site.lhs.dtype)
    call = lifecycle.DotCall(
      lhs, jnp.asarray(w), site.dimension_numbers, cfg
    ).operand('rhs')
    qt = call.quantize()
    parts = {'qvalue': qt.qvalue, 'scale': qt.scale}
    zero = jnp.zeros_like(qt.scale)
    if qt.zero_point is not None:
      parts['zero_point'] = qt.zero_point
      zero = qt.zero_point
    shape = jnp.shape(qt.qvalue)
    to2 = _to_matrix(call, site.contracting)
    return cls(
      as_matrix(jnp.asarray(w, jnp.float32), site.contracting),
      to2(jnp.broadcast_to(qt.scale, shape)),
      to2(jnp.broadcast_to(zero, shape)),
      parts,
      cfg.fwd.rhs.numerics,
      call,
    )

  def quantize(self, w2: jax.Array, rows=None) -> tuple[jax.Array, jax.Array]:
    """(q-values, dequantized) of `w2` (or its `rows` of d_in) on the grid."""
    s, z = self.scale2, self.zero2
    if rows is not None:
      s, z = s[rows], z[rows]
    return quantize_fixed(self.numerics, w2, s, z)

  def parts(self, q2: jax.Array) -> dict:
    """The frozen entry's rhs parts holding q-values `q2` [d_in, d_out]."""
    call = self.call
    shape = jnp.shape(self.rtn['qvalue'])
    flat = _flat_index(call, self.contracting)
    m = np.asarray(
      as_matrix(jnp.arange(flat.size).reshape(call.x.shape), self.contracting)
    )
    vals = (
      jnp.zeros((flat.size,), jnp.float32)
      .at[m.ravel()]
      .set(q2.astype(jnp.float32).ravel())
    )
    q4 = vals[flat.ravel()].reshape(shape)
    out = dict(self.rtn)
    out['qvalue'] = q4.astype(self.rtn['qvalue'].dtype)
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
    return as_matrix(qt.dequant(), self.contracting)


def quantize_fixed(numerics, w2, s, z) -> tuple[jax.Array, jax.Array]:
  """(q, (q - z) s) of `w2` with the fixed scale `s` and zero point `z`."""
  v = divide(w2.astype(jnp.float32), s, numerics.unit) + z
  q = numerics.quantize(v, None).astype(jnp.float32)
  return q, (q - z) * s


def _flat_index(call, contracting) -> np.ndarray:
  """For each element of the tiled view, its flat index in the weight."""
  shape = tuple(call.x.shape)
  idx = np.arange(int(np.prod(shape))).reshape(shape)
  x3 = call.layout.to_canonical(jnp.asarray(idx), call.form)
  return np.asarray(to_view(x3, call.form, call.tile))


def _to_matrix(call, contracting):
  """A view-shaped array -> [d_in, d_out] in `as_matrix`'s order."""
  flat = _flat_index(call, contracting).ravel()
  shape = tuple(call.x.shape)
  n = int(np.prod(shape))
  m = np.asarray(as_matrix(jnp.arange(n).reshape(shape), contracting))
  inv = np.empty(n, np.int64)
  inv[flat] = np.arange(n)

  def to2(a4):
    return jnp.ravel(a4)[inv[m.ravel()]].reshape(m.shape)

  return to2


__all__ = ['Grid', 'check_config', 'quantize_fixed', 'weight_config']
