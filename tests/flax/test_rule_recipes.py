"""The DeepSeek FP8 recipes through rules on a stock model."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import aqtr
import aqtr.flax
from aqtr.core.lowering import sub_jaxprs
from aqtr.rules import Rule

X = jax.random.normal(jax.random.key(0), (16, 32))  # 16 tokens


class Mlp(nnx.Module):
  def __init__(self):
    self.up = nnx.Linear(32, 64, rngs=nnx.Rngs(0))
    self.down = nnx.Linear(64, 32, rngs=nnx.Rngs(1))

  def __call__(self, x):
    return self.down(jax.nn.relu(self.up(x)))


def fp8_dots(fn, *args) -> int:
  """dot_generals of the program whose operands are both fp8."""

  def count(jaxpr) -> int:
    n = 0
    for e in jaxpr.eqns:
      if e.primitive.name == 'dot_general' and all(
        'float8' in str(v.aval.dtype) for v in e.invars
      ):
        n += 1
      for sub in sub_jaxprs(e):
        n += count(sub)
    return n

  return count(jax.make_jaxpr(fn)(*args).jaxpr)


def step_and_serve(q, x):
  fwd = nnx.jit(lambda m, x: m(x))
  grads = nnx.jit(lambda m, x: nnx.grad(lambda m: jnp.sum(m(x) ** 2))(m))(q, x)
  assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
  served = aqtr.flax.convert(q, x)
  np.testing.assert_array_equal(fwd(served, x), fwd(q, x))
  return served


@pytest.mark.slow
def test_maxtext_deepseek_static_scales_calibrated():
  q = aqtr.flax.quantize(Mlp(), Rule('maxtext_deepseek_fp8', weight=True))
  aqtr.flax.calibrate(q, [X, 0.5 * X])
  served = step_and_serve(q, X)
  # The two projections run fp8 x fp8 dots, forward and served.
  assert fp8_dots(lambda m, x: m(x), served, X) == 2


def test_recipe_arguments_are_checked_in_one_line():
  with pytest.raises(ValueError, match='bound must be None'):
    aqtr.presets.maxtext_deepseek_fp8(bound=-1.0)
  with pytest.raises(ValueError, match='tile must be an int'):
    aqtr.presets.deepseek_v3_fp8(tile=0)


@pytest.mark.slow
def test_maxtext_deepseek_fixed_bound():
  cfg = aqtr.presets.maxtext_deepseek_fp8(bound=224.0)
  served = step_and_serve(aqtr.flax.quantize(Mlp(), Rule(cfg, weight=True)), X)
  assert fp8_dots(lambda m, x: m(x), served, X) == 2


@pytest.mark.slow
def test_deepseek_v3_tiles_and_blocks():
  cfg = aqtr.presets.deepseek_v3_fp8(tile=16)
  served = step_and_serve(aqtr.flax.quantize(Mlp(), Rule(cfg, weight=True)), X)
  assert fp8_dots(lambda m, x: m(x), served, X) >= 2
