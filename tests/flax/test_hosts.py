"""The host protocol: one contract, every model kind (nnx, linen, Pax).

Each case builds the same two-layer model three ways and checks what every
feature relies on: the call (`program`, `run_jit`), the parameters
(`params`, `with_params`, `param_tree`, `leaf`), conversion through the
one `aqtr.flax.convert` (holders / frozen ops, `result` conventions) and
the one-line errors of `hosts.of`.
"""

from __future__ import annotations

import functools

import fiddle as fdl
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fiddle import selectors
from flax import nnx

import aqtr
import aqtr.flax.linen as ql
import aqtr.pax
from aqtr.flax import hosts, linen_convert
from aqtr.flax.frozen import is_removed
from aqtr.flax.host import Host
from aqtr.rules import Rule

X = jnp.linspace(-1.0, 1.0, 2 * 8).reshape(2, 8)


class _Lin(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name='out')(nn.relu(nn.Dense(16, name='up')(x)))


class _Nnx(nnx.Module):
  def __init__(self):
    self.up = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
    self.out = nnx.Linear(16, 4, rngs=nnx.Rngs(1))

  def __call__(self, x):
    return self.out(nnx.relu(self.up(x)))


def _nnx():
  return aqtr.flax.quantize(_Nnx(), [Rule('int8')]), None


def _linen():
  m = _Lin()
  return aqtr.flax.quantize(m, [Rule('int8')]), m.init(jax.random.key(0), X)


def _pax():
  t = fdl.Config(aqtr.pax.Linear, features=4)
  t, _ = aqtr.pax.inject(t, [aqtr.pax.Rule(aqtr.presets.int8())])
  return t, fdl.build(t).init(jax.random.key(0), X)


KINDS = {'nnx': _nnx, 'linen': _linen, 'pax': _pax}
CLASSES = {'nnx': 'NnxHost', 'linen': 'LinenHost', 'pax': 'TemplateHost'}


@pytest.mark.parametrize('kind', KINDS)
def test_host_contract(kind):
  model, variables = KINDS[kind]()
  h = hosts.of(model, variables)
  assert isinstance(h, Host) and type(h).__name__ == CLASSES[kind]
  # The call: jitted, eager pure program and the model's own call agree.
  fn, state = h.program()
  y = h.run_jit((X,), {})
  np.testing.assert_array_equal(np.asarray(fn(state, X)), np.asarray(y))
  # Parameters: read, replace (the original untouched), nested view.
  params = h.params()
  assert params and all(h.leaf(p) is not None for p in params)
  path = sorted(params, key=str)[0]
  doubled = h.with_params({path: params[path] * 2})
  np.testing.assert_array_equal(doubled.read_param(path), params[path] * 2)
  np.testing.assert_array_equal(h.read_param(path), params[path])
  tree = h.param_tree()
  node = tree
  for k in h.tree_path(path):
    node = node[k]
  np.testing.assert_array_equal(nn.meta.unbox(node), params[path])
  # The one convert: served output equals trained output, same conventions.
  served = aqtr.flax.convert(model, X, variables=variables)
  s = hosts.served(served)
  assert type(s) is type(h)
  np.testing.assert_array_equal(np.asarray(s.run_jit((X,), {})), y)
  if kind == 'nnx':
    assert served is s.model
  else:
    assert isinstance(served, tuple) and len(served) == 2


@pytest.mark.parametrize('kind', ['linen', 'pax'])
def test_hosts_name_missing_variables(kind):
  model, _ = KINDS[kind]()
  with pytest.raises(TypeError, match=r'^aqtr.flax.convert: .*variables='):
    aqtr.flax.convert(model, X)


def test_hosts_refuse_other_models():
  with pytest.raises(TypeError, match='model must be a flax.linen or'):
    hosts.of(object(), who='aqtr.flax.convert')


def test_stock_convert_holds_frozen_holders():
  model, variables = _linen()
  module, svars = aqtr.flax.convert(model, X, variables=variables)
  held = hosts.of(module, svars).holders()
  assert sorted(p for p, _ in held) == [('out', 'kernel'), ('up', 'kernel')]
  assert ('up', 'kernel') not in hosts.of(module, svars).params()


def test_one_convert_for_a_model_with_explicit_nnx_ops():
  import aqtr.flax.nnx as qn  # noqa: PLC0415

  cfg = aqtr.freezers.configure(aqtr.presets.int8(), rhs='weights')
  m = nnx.Linear(8, 4, dot_general=qn.DotGeneral(cfg), rngs=nnx.Rngs(0))
  y = m(X)
  served = aqtr.flax.convert(m, X)
  assert served is not m and is_removed(served.kernel)
  np.testing.assert_array_equal(served(X), y)
  with pytest.raises(ValueError, match='is not quantized: call'):
    aqtr.flax.convert(nnx.Linear(8, 4, rngs=nnx.Rngs(0)), X)


def test_one_convert_for_a_linen_model_with_explicit_ops():
  """`aqtr.flax.convert` serves a linen model built from aqtr's linen ops
  (built once, in TRAIN): (the same model with its ops in SERVE, serving
  variables), bit for bit; its ops' own CONVERT did the freezing."""
  cfg = aqtr.freezers.configure(aqtr.presets.int8(), rhs='weights')
  dg = functools.partial(ql.DotGeneral, config=cfg)

  class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.relu(nn.Dense(16, dot_general_cls=dg, name='up')(x))
      return nn.Dense(4, dot_general_cls=dg, name='out')(h)

  model = Mlp()
  variables = model.init(jax.random.key(0), X)
  module, svars = aqtr.flax.convert(model, X, variables=variables)
  assert type(module).aqtr_ops_mode is aqtr.Mode.SERVE
  assert type(module).__name__ == 'Mlp' and type(model) is Mlp
  assert is_removed(svars['params']['up']['kernel'])
  entry = svars[ql.FROZEN]['up']['DotGeneral_0']
  ((_, frozen),) = entry.items()
  assert frozen['rhs']['qvalue'].dtype == jnp.int8
  np.testing.assert_array_equal(
    jax.jit(module.apply)(svars, X), jax.jit(model.apply)(variables, X)
  )
  # The legacy path (a CONVERT-mode twin) gives the same serving tree.
  twin = linen_convert.with_ops_mode(model, aqtr.Mode.CONVERT)
  legacy = ql.convert(twin, variables, X)
  assert jax.tree.structure(legacy) == jax.tree.structure(svars)
  for a, b in zip(jax.tree.leaves(legacy), jax.tree.leaves(svars), strict=True):
    np.testing.assert_array_equal(a, b)
  # A linen model without aqtr ops, or whose ops freeze nothing.
  with pytest.raises(ValueError, match='is not quantized: call'):
    dense = nn.Dense(4)
    aqtr.flax.convert(dense, X, variables=dense.init(jax.random.key(0), X))


def test_one_set_mode_for_models_built_from_aqtr_ops():
  """`aqtr.flax.set_mode` switches every explicit op: CALIBRATE records
  static ranges, which `convert` freezes (nnx, linen); Pax ops too."""
  cfg = aqtr.freezers.configure(
    aqtr.presets.int8(), lhs='calibration', rhs='weights'
  )
  dg = functools.partial(ql.DotGeneral, config=cfg)
  dense = nn.Dense(4, dot_general_cls=dg)
  v = dense.init(jax.random.key(0), X)
  cal = aqtr.flax.set_mode(dense, aqtr.Mode.CALIBRATE)
  assert type(dense).__name__ == type(cal).__name__ == 'Dense'
  _, stats = cal.apply(v, X, mutable=[ql.STATS])
  count = stats[ql.STATS]['DotGeneral_0']['lhs']['count']
  assert int(count) == 1
  served, sv = aqtr.flax.convert(dense, X, variables=dict(v, **stats))
  ((_, entry),) = sv[ql.FROZEN]['DotGeneral_0'].items()
  assert 'bound' in entry['lhs']  # the calibrated static range
  with pytest.raises(ValueError, match='count 0'):  # never calibrated
    aqtr.flax.convert(
      dense, X, variables=dict(v, **jax.tree.map(jnp.zeros_like, stats))
    )

  import aqtr.flax.nnx as qn  # noqa: PLC0415

  m = nnx.Linear(8, 4, dot_general=qn.DotGeneral(cfg), rngs=nnx.Rngs(0))
  assert aqtr.flax.set_mode(m, aqtr.Mode.CALIBRATE) is m  # in place
  assert m.dot_general.mode is aqtr.Mode.CALIBRATE
  m(X)
  (entry,) = aqtr.flax.convert(m, X).dot_general.frozen_entries().values()
  assert 'bound' in entry['lhs']

  template, _ = aqtr.pax.inject(
    fdl.Config(aqtr.pax.Linear, features=4),
    [aqtr.pax.Rule(aqtr.presets.int8())],
  )
  got = aqtr.flax.set_mode(template, aqtr.Mode.CALIBRATE)
  modes = {n.mode for n in selectors.select(got, aqtr.pax.EinsumOp)}
  assert modes == {aqtr.Mode.CALIBRATE}
  with pytest.raises(ValueError, match='is not quantized: call'):
    aqtr.flax.set_mode(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), aqtr.Mode.SERVE)
