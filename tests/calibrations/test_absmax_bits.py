"""AbsMax's one-reduction CPU form (`aqtr.core.prims.abs_max_bits`).

Below `absmax.LIBRARY_MIN_SIZE` values the CPU bound is one integer max
over the floats' bits; at and above it, the library's float max plus a
`sum(x - x)` flag. Both forms give the same bits (NaN and inf groups:
inf; subnormal float32 maxima: +0, as XLA:CPU flushes them), on one
device, closed over, and on an 8-device mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import aqtr
from aqtr.calibrations import AbsMax, absmax
from aqtr.core import prims


def _x(dtype, shape=(6, 40), seed=0):
  """Rows: finite, NaN, -NaN, inf, -inf, all-subnormal (and zeros)."""
  rs = np.random.default_rng(seed)
  x = (rs.standard_normal(shape) * 4).astype(np.float32)
  x[1, 3], x[2, 7], x[3, 0], x[4, -1] = np.nan, -np.nan, np.inf, -np.inf
  tiny = float(jnp.finfo(dtype).tiny)
  x[5] = tiny / 4 * rs.choice([-1.0, 0.0, 1.0], shape[1])
  return jnp.asarray(x).astype(dtype)


def _bits(a):
  a = np.asarray(a)
  return a.view(np.dtype(f'u{a.dtype.itemsize}'))


def _cpu(size):
  """`AbsMax.calibrate` with the bits form below `size` values."""

  def f(x, axes):
    old = absmax.LIBRARY_MIN_SIZE
    absmax.LIBRARY_MIN_SIZE = size
    try:
      return jax.jit(lambda x: AbsMax().calibrate(x, axes))(x)
    finally:
      absmax.LIBRARY_MIN_SIZE = old

  return f


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize('axes', [(1,), (0,), (0, 1)])
def test_the_bits_form_gives_the_float_forms_bits(dtype, axes):
  x = _x(dtype)
  bits, library = _cpu(1 << 30)(x, axes), _cpu(0)(x, axes)
  np.testing.assert_array_equal(_bits(bits), _bits(library))
  if axes == (1,):  # Finite rows: max |x|; NaN / inf rows: inf.
    want = np.abs(np.asarray(x[0], np.float32)).max()
    assert float(bits[0, 0]) == want
    assert np.isposinf(np.asarray(bits[1:5], np.float32)).all()
    flushed = dtype != jnp.float16  # float16 subnormals are f32 normals
    assert (float(bits[5, 0]) == 0) == flushed


def _reductions(shape, axes=(1,)):
  """The element types of the reductions of the CPU form's bound."""
  f = jax.jit(lambda x: AbsMax().calibrate(x, axes))
  exp = jax.export.export(f, platforms=('cpu',))
  text = exp(jax.ShapeDtypeStruct(shape, jnp.float32)).mlir_module()
  lines = [ln for ln in text.splitlines() if 'stablehlo.reduce(' in ln]
  return [ln.rsplit('x', 1)[-1].split('>')[0] for ln in lines]


def test_integer_max_in_steps_below_the_library_size():
  assert 8 * 2048 < absmax.LIBRARY_MIN_SIZE <= 256 * 256
  assert _reductions((8, 64)) == ['i32', 'i32']  # 64 = 2 steps of 32
  assert _reductions((8, 20)) == ['i32']
  assert set(_reductions((8, 2048))) == {'i32'}  # A batch-8 activation.
  assert _reductions((256, 256)) == ['f32', 'f32']  # max |x|, sum(x - x)


def test_the_steps_give_the_max_of_any_length():
  rs = np.random.default_rng(3)
  for shape, axes in [
    ((3, 1000), (1,)),
    ((70, 33), (0, 1)),
    ((2, 5, 97), (2,)),
  ]:
    v = jnp.asarray(rs.integers(0, 1 << 30, shape), jnp.int32)
    got = jax.jit(lambda v, axes=axes: prims.max_in_steps(v, axes))(v)
    np.testing.assert_array_equal(got, np.max(v, axis=axes, keepdims=True))


def test_the_derivative_is_the_float_maxs_where_finite():
  x = _x(jnp.float32)

  def float_form(x):
    b = jnp.max(jnp.abs(x), axis=1, keepdims=True)
    return jnp.where(
      jnp.isfinite(b) & ~jnp.isnan(x).any(1, keepdims=True), b, jnp.inf
    )

  t = jnp.asarray(np.random.default_rng(4).standard_normal(x.shape), x.dtype)
  got = jax.jvp(lambda x: prims.abs_max_bits(x, (1,)), (x,), (t,))
  want = jax.jvp(float_form, (x,), (t,))
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_array_equal(got[1], want[1])
  g = jax.grad(lambda x: prims.abs_max_bits(x, (1,))[0, 0])(x)
  assert (
    g[0].tolist()
    == jnp.where(
      jnp.abs(x[0]) == jnp.abs(x[0]).max(), jnp.sign(x[0]), 0
    ).tolist()
  )


@pytest.mark.skipif(jax.device_count() < 8, reason='needs 8 host devices')
def test_explicitly_sharded_rows_longer_than_a_step():
  mesh = jax.make_mesh((2, 4), ('a', 'b'), axis_types=(AxisType.Explicit,) * 2)
  x = _x(jnp.float32, (8, 296))  # 296: padded to 10 steps of 32
  want = jax.jit(lambda x: AbsMax().calibrate(x, (1,)))(x)
  with jax.set_mesh(mesh):
    for spec in (P(None, 'b'), P('a', 'b'), P('a', None)):
      xs = jax.device_put(x, NamedSharding(mesh, spec))
      got = jax.jit(lambda x: AbsMax().calibrate(x, (1,)))(xs)
      np.testing.assert_array_equal(_bits(got), _bits(want))


def test_closed_over_transposed_input_gives_the_arguments_bound():
  # XLA:CPU's constant folding once read a bit cast of a transposed
  # closed-over view wrongly (tests/core/test_closed_over_inputs.py).
  c = _x(jnp.float32).T  # [40, 6]: the bound of c.T's rows
  folded = jax.jit(lambda: AbsMax().calibrate(c.T * 1.5, (1,)))()
  want = jax.jit(lambda a: AbsMax().calibrate(a.T * 1.5, (1,)))(c)
  np.testing.assert_array_equal(_bits(folded), _bits(want))


@pytest.mark.skipif(jax.device_count() < 8, reason='needs 8 host devices')
def test_a_sharded_int8_dot_with_in_shardings_and_no_mesh_context():
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ('a', 'b'))
  x = _x(jnp.float32, (8, 64))
  w = jnp.asarray(np.random.default_rng(1).standard_normal((64, 16)))
  w = w.astype(jnp.float32).at[3, 2].set(jnp.nan)
  dn = (((1,), (0,)), ((), ()))

  def f(x, w):
    return aqtr.dot_general(x, w, dn, aqtr.presets.int8())

  sh = (NamedSharding(mesh, P('a', 'b')), NamedSharding(mesh, P('b', None)))
  got = jax.jit(f, in_shardings=sh)(x, w)
  np.testing.assert_array_equal(_bits(got), _bits(jax.jit(f)(x, w)))
  assert np.isnan(np.asarray(got)[:, 2]).all()  # The NaN weight column.


def test_other_dtypes_are_left_to_the_float_form():
  assert prims.abs_max_bits(jnp.ones(3, jnp.float8_e4m3fn), (0,)) is None
  b = AbsMax().calibrate(jnp.array([[1.0, -2.0]], jnp.float8_e4m3fn), (1,))
  assert float(b[0, 0]) == 2.0
