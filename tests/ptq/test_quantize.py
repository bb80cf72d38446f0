"""aqtr.ptq.quantize end to end: nnx, linen and the Pax-style LM serve the
solved weights from an ordinary serving tree; bad input is one line."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import aqtr
import aqtr.ptq as ptq
from aqtr.core import codecs
from aqtr.core.qtensor import QTensor
from aqtr.rules import Rule
from aqtr.tilings.subchannel import SubChannel

from .helpers import correlated, ptq_entry, solution, weight_only

INT4 = [Rule(aqtr.presets.int4_weight_only())]


class Mlp(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(32, 64, rngs=rngs)
    self.b = nnx.Linear(64, 16, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.b(jax.nn.gelu(self.a(x)))


class LinenMlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(16)(jax.nn.gelu(nn.Dense(64)(x)))


def _batches(n=3, tokens=64, d=32):
  return [correlated(jax.random.key(i), tokens, d) for i in range(n)]


def _entry(holder_entries, site):
  key = site.holder[2]
  return holder_entries[key][ptq_entry(site)]['rhs']


def test_nnx_serves_the_solution_bit_for_bit():
  m = Mlp(nnx.Rngs(0))
  xs = _batches()
  served, rep = ptq.quantize(m, INT4, xs, method='gptq')
  rtn = aqtr.flax.convert(aqtr.flax.quantize(m, INT4), xs[0])
  sol = solution(m, INT4, xs)
  assert [r.path for r in rep.layers] == sorted(sol)
  for r in rep.layers:
    assert r.error < r.rtn_error and r.tokens == 192
  for name in ('a', 'b'):
    site, g, (q, wq) = sol[f'{name}/dot_general0']
    parts = _entry(getattr(served, name).kernel.entries(), site)
    ref = _entry(getattr(rtn, name).kernel.entries(), site)
    # An ordinary serving tree: convert's layout and scales, new values.
    assert jax.tree.map(jnp.shape, parts) == jax.tree.map(jnp.shape, ref)
    np.testing.assert_array_equal(parts['scale'], ref['scale'])
    np.testing.assert_array_equal(g.dequant(parts), wq)

  # SERVE under jit is the engine's dots of the stored QTensors (a served
  # submodule called on its own refuses: it is the whole model that serves).
  def dot(name, x):
    site, g, _ = sol[f'{name}/dot_general0']
    parts = _entry(getattr(served, name).kernel.entries(), site)
    parts = codecs.decode_parts(parts, g.numerics)  # Packed int4 codes.
    qt = QTensor(parts['qvalue'], parts['scale'], g.call.layout, g.call.form)
    return aqtr.dot_general(x, qt, site.dimension_numbers, site.config)

  bias = served.a.bias.get_value()[None]
  want = jax.jit(lambda x: dot('b', jax.nn.gelu(dot('a', x) + bias)))(xs[0])
  got = nnx.jit(lambda mod, x: mod(x))(served, xs[0])
  assert float(jnp.abs(want).max()) > 0
  np.testing.assert_array_equal(got, want)


def _float_error(out, ref):
  return float(jnp.mean((out - ref) ** 2))


def test_linen_model():
  model = LinenMlp()
  xs = _batches()
  v = model.init(jax.random.key(0), xs[0])
  (module, sv), rep = ptq.quantize(model, INT4, xs, variables=v)
  (rmod, rv), _ = ptq.quantize(model, INT4, xs, variables=v, method='rtn')
  sol = solution(model, INT4, xs, v)
  for site, g, (_, wq) in sol.values():
    mpath, param, _ = site.holder
    box = sv['params'][mpath[0]][param]
    np.testing.assert_array_equal(g.dequant(_entry(box.entries(), site)), wq)
  want = model.apply(v, xs[0])
  got = jax.jit(module.apply)(sv, xs[0])
  assert _float_error(got, want) < _float_error(rmod.apply(rv, xs[0]), want)
  assert all(r.error < r.rtn_error for r in rep.layers)


def test_bad_input_is_one_line():
  m = nnx.Linear(32, 8, rngs=nnx.Rngs(0))
  xs = _batches(2)
  with pytest.raises(ValueError, match='no weight op'):
    ptq.quantize(m, [Rule(aqtr.presets.int8(), path='nowhere')], xs)
  int8 = aqtr.presets.int8()
  none = dataclasses.replace(int8.fwd.rhs, numerics=aqtr.numerics.get('none')())
  act_only = dataclasses.replace(
    int8, fwd=dataclasses.replace(int8.fwd, rhs=none)
  )
  with pytest.raises(ValueError, match='quantizes its weight'):
    ptq.quantize(m, [Rule(act_only)], xs)
  with pytest.raises(ValueError, match='calibration batch 1 has shapes'):
    ptq.quantize(m, INT4, [xs[0], xs[1][:5]])
  with pytest.raises(ValueError, match='calibration batch 0'):
    ptq.quantize(m, INT4, [jnp.ones((4, 7))])
  with pytest.raises(ValueError, match='calibration_batches is empty'):
    ptq.quantize(m, INT4, [])
  g48 = weight_only(
    aqtr.numerics.get('int_symmetric')(bits=4), SubChannel(tile_size=48)
  )
  with pytest.raises(
    ValueError, match=r'aqtr.ptq: dot_general0: .*tile_size=48 does not divide'
  ):
    ptq.quantize(m, [Rule(g48)], xs)
  with pytest.raises(ValueError, match='stateful calibration'):
    ptq.quantize(m, [Rule(aqtr.presets.int4_lsq())], xs)
  with pytest.raises(ValueError, match='method must be one of'):
    ptq.quantize(m, INT4, xs, method='obq')
  with pytest.raises(ValueError, match='Gptq.percdamp'):
    ptq.Gptq(percdamp=-1.0)
  with pytest.warns(UserWarning, match='dot_general0: 4 calibration tokens'):
    ptq.quantize(m, INT4, [xs[0][:4]])
  twin = xs[0].at[:, 1].set(xs[0][:, 0])  # H exactly singular
  with pytest.raises(
    ValueError, match='dot_general0: gptq.solve: H is singular'
  ):
    ptq.quantize(m, INT4, [twin], percdamp=0.0)


def test_scanned_layers_are_one_line():
  class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return nn.Dense(16)(x), None

  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      scan = nn.scan(
        Layer,
        variable_axes={'params': 0},
        split_rngs={'params': True},
        length=2,
      )
      return scan()(x, None)[0]

  x = jnp.ones((4, 16))
  v = Stack().init(jax.random.key(0), x)
  with pytest.raises(ValueError, match='layers unrolled'):
    ptq.quantize(Stack(), INT4, [x], variables=v)


class RematMlp(nn.Module):
  """Blocks under `nn.remat`: the calibration pass records them too."""

  @nn.compact
  def __call__(self, x):
    dense = nn.remat(nn.Dense)
    return dense(16)(jax.nn.gelu(dense(64)(x)))


def test_remat_layers_are_calibrated_and_solved():
  xs = _batches()
  v = RematMlp().init(jax.random.key(0), xs[0])
  (module, sv), rep = ptq.quantize(RematMlp(), INT4, xs, variables=v)
  assert len(rep.layers) == 2 and all(r.error < r.rtn_error for r in rep.layers)
  # Same solution as the plain model with the same parameters.
  (plain, pv), _ = ptq.quantize(LinenMlp(), INT4, xs, variables=_renamed(v))
  np.testing.assert_array_equal(
    jax.jit(module.apply)(sv, xs[0]), jax.jit(plain.apply)(pv, xs[0])
  )


def _renamed(v):
  """RematMlp's parameters under LinenMlp's module names."""
  p = v['params']
  return {
    'params': {
      'Dense_0': p['CheckpointDense_0'],
      'Dense_1': p['CheckpointDense_1'],
    }
  }
