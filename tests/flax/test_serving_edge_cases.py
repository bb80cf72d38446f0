"""aqtr.flax convert / sizes on bad arguments: one clear line."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import aqtr
import aqtr.flax
from aqtr.rules import Rule

X = jnp.ones((2, 32))


def _linen():
  q = aqtr.flax.quantize(nn.Dense(8), [Rule(aqtr.presets.int8())])
  v = q.init(jax.random.key(0), X)
  return q, v


def test_sizes_of_a_linen_model_needs_its_variables():
  q, v = _linen()
  module, sv = aqtr.flax.convert(q, X, variables=v)
  with pytest.raises(TypeError, match='sizes: a linen model needs variables'):
    aqtr.flax.sizes(module)
  got = aqtr.flax.sizes(module, sv)
  assert got.float_kernel_bytes == 32 * 8 * 4
  assert aqtr.flax.sizes((module, sv)) == got  # what convert returned


@pytest.mark.parametrize('keep, err', [('(up', ValueError), (3, TypeError)])
def test_convert_keep_must_be_a_valid_regex(keep, err):
  q = aqtr.flax.quantize(
    nnx.Linear(32, 8, rngs=nnx.Rngs(0)), [Rule(aqtr.presets.int8())]
  )
  with pytest.raises(err, match=r'convert: keep'):
    aqtr.flax.convert(q, X, keep=keep)


def test_quantize_names_methods():
  with pytest.raises(ValueError, match='methods'):
    aqtr.flax.quantize(
      nnx.Linear(4, 2, rngs=nnx.Rngs(0)),
      [Rule(aqtr.presets.int8())],
      methods=('encode',),
    )


@pytest.mark.parametrize(
  'ulps, outcome', [(0, None), (3, 'warn'), (999, 'raise')]
)
def test_serve_check_names_the_ulp_distance(ulps, outcome):
  from aqtr.flax import serving  # noqa: PLC0415

  base = jnp.array([1.0, -2.0, 3.5], jnp.float32)
  bits = jax.lax.bitcast_convert_type(base, jnp.int32)
  moved = jax.lax.bitcast_convert_type(bits + ulps, jnp.float32)
  outs = iter([base, moved])

  class Fake:  # a host whose jitted call gives the next output
    def run_jit(self, *a):
      return next(outs)

  if outcome == 'raise':
    with pytest.raises(ValueError, match=f'{ulps} ULP'):
      serving.check_served(Fake(), Fake(), (), {})
  elif outcome == 'warn':
    with pytest.warns(UserWarning, match=f'by up to {ulps} ULP'):
      serving.check_served(Fake(), Fake(), (), {})
  else:
    serving.check_served(Fake(), Fake(), (), {})


class _Two(nnx.Module):
  def __init__(self):
    self.up = nnx.Linear(32, 16, rngs=nnx.Rngs(0))
    self.out = nnx.Linear(16, 4, rngs=nnx.Rngs(1))

  def __call__(self, x):
    return self.out(self.up(x))


def test_a_served_submodule_called_alone_is_one_line():
  served = aqtr.flax.convert(
    aqtr.flax.quantize(_Two(), [Rule(aqtr.presets.int8())]), X
  )
  served(X)  # the served model itself serves its frozen values
  with pytest.raises(ValueError, match='call the served model itself'):
    served.up(X)
