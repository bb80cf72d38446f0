"""Tests for aqtr/core/dimension_numbers.py: layouts and dot axes."""

from __future__ import annotations

import math

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st
from jax import lax

from aqtr.core.dimension_numbers import DotLayout, OperandLayout, normalize


@st.composite
def layouts(draw):
  rank = draw(st.integers(0, 5))
  shape = tuple(draw(st.integers(1, 3)) for _ in range(rank))
  axes = draw(st.permutations(range(rank)))
  nb = draw(st.integers(0, rank))
  nc = draw(st.integers(0, rank - nb))
  return OperandLayout(shape, tuple(axes[:nb]), tuple(axes[nb : nb + nc]))


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(layouts(), st.sampled_from(['fk', 'kf']))
def test_canonical_round_trip(lay, form):
  x = np.arange(math.prod(lay.shape), dtype=np.float32).reshape(lay.shape)
  c = lay.to_canonical(x, form)
  assert c.shape == lay.canonical_shape(form)
  assert lay.b * lay.f * lay.k == x.size
  np.testing.assert_array_equal(lay.from_canonical(c, form), x)
  # every axis is exactly one of batch / free / contract
  assert sorted(lay.batch + lay.free + lay.contract) == list(range(x.ndim))


def test_canonical_layout_values():
  lay = OperandLayout((4, 3, 5), batch=(2,), contract=(0,))
  x = np.arange(60).reshape(4, 3, 5)
  fk = np.asarray(lay.to_canonical(x, 'fk'))  # [B=5, F=3, K=4]
  np.testing.assert_array_equal(fk, x.transpose(2, 1, 0))
  kf = np.asarray(lay.to_canonical(x, 'kf'))  # [B=5, K=4, F=3]
  np.testing.assert_array_equal(kf, x.transpose(2, 0, 1))
  with pytest.raises(ValueError, match='form'):
    lay.perm('xx')


@pytest.mark.parametrize(
  'shape,contract,form',
  [
    ((8, 4), (0,), 'kf'),  # [K, N]
    ((4, 8), (1,), 'fk'),  # [N, K]
    ((2, 8, 4), (0, 1), 'kf'),
    ((8,), (0,), 'fk'),  # no free axes
  ],
)
def test_natural_form(shape, contract, form):
  assert OperandLayout(shape, (), contract).natural_form() == form


@st.composite
def dot_shapes(draw):
  nb, nc = draw(st.integers(0, 2)), draw(st.integers(0, 2))
  nl, nr = draw(st.integers(0, 2)), draw(st.integers(0, 2))
  size = st.integers(1, 3)
  b = [draw(size) for _ in range(nb)]
  c = [draw(size) for _ in range(nc)]
  lroles = draw(
    st.permutations(
      [('b', i) for i in range(nb)]
      + [('c', i) for i in range(nc)]
      + [('f', draw(size)) for _ in range(nl)]
    )
  )
  rroles = draw(
    st.permutations(
      [('b', i) for i in range(nb)]
      + [('c', i) for i in range(nc)]
      + [('f', draw(size)) for _ in range(nr)]
    )
  )

  def dims(roles):
    return tuple({'b': b, 'c': c}[r][i] if r != 'f' else i for r, i in roles)

  def where(roles, r, n):
    return tuple(roles.index((r, i)) for i in range(n))

  dn = (
    (where(lroles, 'c', nc), where(rroles, 'c', nc)),
    (where(lroles, 'b', nb), where(rroles, 'b', nb)),
  )
  return dims(lroles), dims(rroles), dn


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(dot_shapes())
def test_out_shape_is_lax_output_shape(problem):
  lshape, rshape, dn = problem
  lay = DotLayout.create(lshape, rshape, dn)
  want = jax.eval_shape(
    lambda a, b: lax.dot_general(a, b, dn),
    jax.ShapeDtypeStruct(lshape, jnp.float32),
    jax.ShapeDtypeStruct(rshape, jnp.float32),
  ).shape
  assert lay.out_shape == want
  assert math.prod(want) == lay.lhs.b * lay.lhs.f * lay.rhs.f
  assert lay.lhs.k == lay.rhs.k and lay.lhs.b == lay.rhs.b
  assert lay.dimension_numbers == normalize(lshape, rshape, dn)


def test_normalize_makes_axes_non_negative_tuples():
  dn = normalize((2, 3, 4), (4, 2), (([-1], [0]), ([0], [-1])))
  assert dn == (((2,), (0,)), ((0,), (1,)))


@pytest.mark.parametrize(
  'lshape,rshape,dn,match',
  [
    ((3, 4), (4, 2), (((1,), (1,)), ((), ())), 'lhs axis 1 has size 4'),
    ((3, 4), (4, 2), (((2,), (0,)), ((), ())), r'allowed -2\.\.1'),
    ((3, 4), (4, 2), (((1,), (-3,)), ((), ())), 'rhs_contracting'),
    ((3, 4), (4, 2), (((1,), ()), ((), ())), 'same length'),
    ((3, 4), (3, 2), (((1,), (1,)), ((0,), ())), 'same length'),
    ((3, 4), (4, 3), (((1,), (0,)), ((1,), (0,))), 'both'),
    ((3, 4), (4, 2), (((1, 1), (0, 0)), ((), ())), 'repeats'),
    ((3, 4), (4, 2), ((1, 0),), 'dimension_numbers'),
    ((3, 4), (4, 2), (((1,), (0,)), ((), (0,))), 'same length'),
    ((3, 4), (4, 2), ((1, 0), ((), ())), 'sequence of ints'),
  ],
)
def test_normalize_errors_name_the_field(lshape, rshape, dn, match):
  with pytest.raises(ValueError, match=match):
    normalize(lshape, rshape, dn)
