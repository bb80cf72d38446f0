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
  >>> from aqtr.flax.sites import WeightSite
  >>> w = jax.random.normal(jax.random.key(0), (8, 4))
  >>> s = WeightSite(
  ...   op_path='op', dimension_numbers=(((1,), (0,)), ((), ())),
  ...   config=aqtr.presets.int8_weight_only(),
  ...   other=jax.ShapeDtypeStruct((2, 8), jnp.float32),
  ...   weight=jax.ShapeDtypeStruct((8, 4), jnp.float32))
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

from aqtr.core import codecs, slot_state
from aqtr.core.config import TensorConfig
from aqtr.core.qtensor import to_view
from aqtr.core.quantizer import quantize_scaled, quantize_view
from aqtr.freezers import configure, lifecycle
from aqtr.freezers.weights import frozen_view
from aqtr.numerics.nvfp4 import NvFp4
from aqtr.tilings.per_channel import PerChannel
from aqtr.tilings.per_tensor import PerTensor
from aqtr.tilings.subchannel import SubChannel


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
  site_config: object = None

  @classmethod
  def of(cls, site, w: jax.Array) -> Grid:
    """The engine's grid of weight `w` of op `site` (a `WeightSite`)."""
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
      site.config,
    )

  def quantize(self, w2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(q-values, dequantized) of `w2` [d_in, d_out] on the grid."""
    return quantize_fixed(self.numerics, w2, self.scale2, self.zero2)

  def parts(self, q2: jax.Array, scale2=None, zero2=None) -> dict:
    """The frozen entry's rhs parts holding q-values `q2` [d_in, d_out]
    (and the grid `scale2`, `zero2` when it is not the RTN one)."""
    view, to2 = _maps_of(self.call, self.contracting, self.call.x.shape)
    out = dict(self.rtn)
    out['qvalue'] = jnp.asarray(to2.to_view(q2, view)).astype(
      self.rtn['qvalue'].dtype
    )
    for name, m in (('scale', scale2), ('zero_point', zero2)):
      if m is None or name not in out:
        continue
      full = to2.to_view(m, view)
      keep = tuple(
        slice(0, 1) if n == 1 else slice(None) for n in out[name].shape
      )
      out[name] = jnp.asarray(full[keep]).astype(out[name].dtype)
    # Stored as CONVERT stores it (integer dots: the contraction minor).
    return frozen_view(self.call, out)

  def regroup(self) -> tuple[int, Regroup | None]:
    """(group size along d_in, `Regroup`) for per-group grids refreshed
    as GPTQ reaches them; (0, None) when the grid has one group per
    column (per-channel: nothing to refresh)."""
    rhs = self.site_config.fwd.rhs
    if isinstance(rhs.tiling, PerChannel | PerTensor):
      return 0, None
    _, to2 = _maps_of(self.call, self.contracting, self.call.x.shape)
    ok = (
      isinstance(rhs.tiling, SubChannel)
      and self.call.form == 'kf'
      and np.array_equal(to2.view_index, to2.index)
      and not isinstance(rhs.numerics, NvFp4)
    )
    if not ok:
      raise ValueError(
        f'dynamic groups (static_groups=False) need sub-channel tiles of a '
        f'weight whose matrix is its tiled view, and a scale per group '
        f'alone (NVFP4 shares a tensor scale); got {rhs.tiling!r} with '
        f'{type(rhs.numerics).__name__}: use static_groups=True.'
      )
    return int(self.call.tile), Regroup(tensor=rhs)

  @property
  def contracting(self) -> tuple[int, ...]:
    return tuple(self.call.call.dimension_numbers[0][1])

  def dequant(self, parts: dict) -> jax.Array:
    """The weight the frozen `parts` serve, as [d_in, d_out] (`parts`
    as `parts()` gives them or as stored, `aqtr.core.codecs`)."""
    parts = codecs.decode_parts(parts, self.numerics)
    qt = self.call.qtensor(  # Either stored view (the scale tells).
      parts['qvalue'], parts['scale'], parts.get('zero_point')
    )
    w = np.asarray(qt.dequant())  # One program when eager (core.eager).
    _, to2 = _maps_of(self.call, self.contracting, w.shape)
    return jnp.asarray(to2.from_weight(w))


@functools.partial(jax.jit, static_argnums=0)
def quantize_fixed(numerics, w2, s, z) -> tuple[jax.Array, jax.Array]:
  """(q, (q - z) s) of `w2` with the fixed scale `s` and zero point `z`
  (the core's rounding step, `aqtr.core.quantizer.quantize_scaled`)."""
  q = quantize_scaled(w2, s, numerics, z).astype(jnp.float32)
  return q, (q - z) * s


@dataclasses.dataclass(frozen=True)
class Regroup:
  """The grid of one group of rows [group, d_out] by the rule's own
  calibration and numerics (`quantize_view` of the group as one tile).

  Attributes:
    tensor: the weight's TensorConfig.
  """

  tensor: TensorConfig

  def __call__(self, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    r = quantize_view(rows[None, None], self.tensor, 'kf')
    s = r.s.reshape(-1)
    z = jnp.zeros_like(s) if r.z is None else r.z.reshape(-1)
    return s, z


def _call(site, w):
  cfg = weight_config(site.config)
  return lifecycle.DotCall(site.other, w, site.dimension_numbers, cfg).operand(
    'rhs'
  )


def _engine(site, w) -> dict:
  """The engine's frozen parts of `w` (RTN: what CONVERT stores)."""
  dn = site.dimension_numbers
  return _engine_jit(dn, site.config, site.other, w)


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

  def to_view(self, m, view) -> np.ndarray:
    """A [d_in, d_out] matrix -> the tiled view of shape `view`."""
    flat = np.empty(self.index.size, np.asarray(m).dtype)
    flat[self.index] = np.asarray(m).ravel()
    return flat[self.view_index].reshape(view)

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


__all__ = ['Grid', 'Regroup', 'check_config', 'quantize_fixed', 'weight_config']
