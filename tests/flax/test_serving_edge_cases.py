"""aqtr.flax convert / sizes on bad arguments: one clear line."""

from __future__ import annotations

import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import aqtr
import aqtr.flax
from aqtr.rules import Rule

X = jnp.ones((2, 32))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


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
  'ulps, fenced, outcome',
  [
    (0, True, None),
    (3, True, 'raise'),  # CPU: the programs fuse alike, 1 ULP is a bug
    (3, False, 'warn'),  # a backend whose fusion boundary is not kept
    (999, False, 'raise'),
  ],
)
def test_serve_check_names_the_ulp_distance(monkeypatch, ulps, fenced, outcome):
  from aqtr.flax import serving  # noqa: PLC0415

  base = jnp.array([1.0, -2.0, 3.5], jnp.float32)
  bits = jax.lax.bitcast_convert_type(base, jnp.int32)
  moved = jax.lax.bitcast_convert_type(bits + ulps, jnp.float32)
  outs = iter([base, moved])

  class Fake:  # a host whose jitted call gives the next output
    def run_jit(self, *a):
      return next(outs)

  monkeypatch.setattr(serving, 'fusion_fenced', lambda: fenced)
  if outcome == 'raise':
    with pytest.raises(ValueError, match=f'{ulps} ULP') as e:
      serving.check_served(Fake(), Fake(), (), {})
    # A few ULP on CPU: the message names XLA's scheduler (see
    # tests/models/test_serve_train_scheduler.py); a large distance not.
    scheduler = 'concurrency_optimized_scheduler=false' in str(e.value)
    assert scheduler == (ulps <= serving.FUSION_ULP)
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
  assert 'Frozen' in repr(nnx.state(served))  # printing is fine
  with pytest.raises(ValueError, match='call the served model itself'):
    served.up(X)


# A stock linen model, compiled with XLA's DEFAULT flags (the test session
# runs LLVM at -O0, which never contracts a multiply-add into an FMA): its
# NVFP4 down projection sums two 16-wide blocks, where the trained and the
# served program used to fuse the scales differently (2.4e-7 apart).
_STOCK = """
import jax, numpy as np, flax.linen as nn, aqtr.flax as af
from aqtr.rules import Rule

class Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(64, use_bias=False)(nn.RMSNorm()(x))
    x = x + nn.Dense(32, use_bias=False)(nn.gelu(h))
    return nn.Dense(8)(nn.RMSNorm()(x))

mod = Mlp()
x = jax.random.normal(jax.random.key(32), (2, 8, 32))
v = jax.jit(mod.init)(jax.random.key(0), x)
q = af.quantize(mod, [Rule('nvfp4', weight=True)])
sm, sv = af.convert(q, x, variables=v, check=False)
y, want = jax.jit(sm.apply)(sv, x), jax.jit(q.apply)(v, x)
np.testing.assert_array_equal(y, want)
"""


def test_stock_model_serves_what_it_trains_under_default_xla_flags():
  env = dict(os.environ, XLA_FLAGS='', JAX_PLATFORMS='cpu')
  got = subprocess.run(
    [sys.executable, '-c', _STOCK],
    env=env,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert got.returncode == 0, got.stderr[-2000:]
