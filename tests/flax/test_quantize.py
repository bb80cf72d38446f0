"""aqtr.flax.quantize: stock linen / nnx models quantized by rules."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import stock_models as sm
from flax import nnx

import aqtr
import aqtr.flax as af
import aqtr.pax
from aqtr.core.lowering import is_dot, sub_jaxprs
from aqtr.flax import Rule
from aqtr.flax.frozen import FrozenBox, is_holder

IDS = jax.random.randint(jax.random.key(0), (2, sm.T), 0, sm.VOCAB)
IMG = jax.random.normal(jax.random.key(1), (2, 8, 8, 3))
TOK = jax.random.normal(jax.random.key(2), (16, sm.D))


def _dots(jaxpr) -> collections.Counter:
  """(primitive, lhs dtype) of every dot in `jaxpr`, recursively."""
  found = collections.Counter()
  for eqn in jaxpr.eqns:
    if is_dot(eqn) or eqn.primitive.name == 'ragged_dot_general':
      name = 'dot_general' if is_dot(eqn) else eqn.primitive.name
      found[(name, str(eqn.invars[0].aval.dtype))] += 1
    for sub in sub_jaxprs(eqn):
      found += _dots(sub)
  return found


def _int8(counter) -> int:
  return sum(n for (_, dt), n in counter.items() if dt == 'int8')


def _nnx_call(model, x):
  return nnx.jit(lambda m, x: m(x))(model, x)


def _nnx_loss(model, x):
  out = model(x)
  return jnp.mean(out**2) if out.ndim == 2 else _lm_loss(out, x)


def _lm_loss(logits, ids):
  return optax.softmax_cross_entropy_with_integer_labels(
    logits[:, :-1], ids[:, 1:]
  ).mean()


def _nnx_jaxprs(model, x):
  graphdef, state = nnx.split(model)

  def fwd(state):
    return nnx.merge(graphdef, state)(x)

  def grad(state):
    return jax.grad(lambda s: _nnx_loss(nnx.merge(graphdef, s), x))(state)

  return jax.make_jaxpr(fwd)(state).jaxpr, jax.make_jaxpr(grad)(state).jaxpr


def _linen_jaxprs(model, variables, x, loss):
  def fwd(v):
    return model.apply(v, x)

  def grad(v):
    return jax.grad(lambda v: loss(model.apply(v, x)))(v)

  return (
    jax.make_jaxpr(fwd)(variables).jaxpr,
    jax.make_jaxpr(grad)(variables).jaxpr,
  )


def _same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --- nnx Llama (nnx.scan over stacked layers under nnx.remat) -------------


@pytest.fixture(scope='module')
def llama():
  return sm.Llama(nnx.Rngs(0))


def test_llama_int8_dots_per_pass(llama):
  q = af.quantize(llama, [Rule('int8')])
  fwd, grad = _nnx_jaxprs(q, IDS)
  # 8 ops in the scanned block (traced once: 6 weight ops, 2 attention
  # einsums) + the head.
  assert _int8(_dots(fwd)) == 8 + 1
  # Forward 9; the remat recomputation of the block but for `down` (no
  # gradient needs its output); each op's two gradient dots.
  assert _int8(_dots(grad)) == 9 + 7 + 2 * 9
  assert _int8(_dots(_nnx_jaxprs(llama, IDS)[1])) == 0


def test_llama_weight_only_rule_by_path_and_report(llama):
  rules = [
    Rule(None, path='head'),
    Rule('int8', path='layers/.*', weight=True),
  ]
  q = af.quantize(llama, rules)
  rep = af.report(q, IDS)
  assert len(rep.quantized_paths()) == 6
  assert rep.float_paths() == [
    'layers/einsum0',
    'layers/einsum1',
    'head/dot_general0',
  ]
  assert {e.weight for e in rep.ops if e.quantized} == {'rhs'}
  line = next(x for x in str(rep).splitlines() if 'layers/o/' in x)
  assert line.split()[:5] == [
    'layers/o/einsum0',
    'int8',
    '[rule',
    '1]',
    'jnp.einsum',
  ]
  assert _int8(_dots(_nnx_jaxprs(q, IDS)[0])) == 6
  by_class = af.quantize(llama, [Rule('int8', layer=nnx.Einsum)])
  assert af.report(by_class, IDS).quantized_paths() == ['layers/o/einsum0']


def test_llama_float_rules_are_bit_exact_and_tree_unchanged(llama):
  q = af.quantize(llama, [Rule('float')])
  _same(_nnx_call(q, IDS), _nnx_call(llama, IDS))
  a, b = nnx.state(llama), nnx.state(af.quantize(llama, [Rule('int8')]))
  assert jax.tree.structure(a) == jax.tree.structure(b)
  _same(a, b)


def _train(model, steps, x):
  opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt):
    loss, g = nnx.value_and_grad(lambda m: _nnx_loss(m, x))(model)
    opt.update(model, g)
    return loss

  return [float(step(model, opt)) for _ in range(steps)]


@pytest.mark.slow
def test_llama_qat_trains_close_to_float(llama):
  flt = _train(nnx.clone(llama), 8, IDS)
  qat = _train(af.quantize(llama, [Rule('int8')]), 8, IDS)
  assert qat[-1] < 0.8 * qat[0]
  assert abs(qat[-1] - flt[-1]) < 0.05 * flt[-1]


def test_llama_convert_serve_equals_train_and_orbax(llama, tmp_path):
  q = af.quantize(llama, [Rule('int8')])
  y = _nnx_call(q, IDS)
  served = af.convert(q, IDS, check=False)  # compared here
  assert is_holder(served.head.kernel)
  assert is_holder(served.layers.q.kernel)
  assert not any(
    isinstance(v, nnx.Param) and 'kernel' in str(p)
    for p, v in nnx.iter_graph(served)
  )
  _same(_nnx_call(served, IDS), y)
  s = af.sizes(served)
  per_layer = (
    sm.D * sm.HD * (sm.HEADS + 2 * sm.KV + sm.HEADS) + 3 * sm.D * sm.FF
  )
  assert s.float_kernel_bytes == 4 * (sm.LAYERS * per_layer + sm.D * sm.VOCAB)
  assert s.kernel_ratio < 0.32
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / 'served', nnx.state(served))
  ckpt.wait_until_finished()
  other = af.quantize(sm.Llama(nnx.Rngs(7)), [Rule('int8')])
  fresh = af.convert(other, IDS, check=False)
  restored = ckpt.restore(tmp_path / 'served', nnx.state(fresh))
  nnx.update(fresh, restored)
  _same(_nnx_call(fresh, IDS), y)


class _Tied(nnx.Module):
  """Embedding table looked up and reused for the logits (`attend`)."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(sm.VOCAB, sm.D, rngs=rngs)
    self.w = nnx.Param(jnp.ones((sm.D, sm.D)))

  def __call__(self, ids):
    h = self.embed(ids) @ self.w[...] * jnp.mean(self.w[...])
    return self.embed.attend(h)


def test_parameter_read_elsewhere_stays_and_its_ops_are_stored():
  q = af.quantize(_Tied(nnx.Rngs(0)), [Rule('int8')])
  assert [e.weight for e in af.report(q, IDS).ops] == ['rhs', 'rhs']
  # `attend` reads embedding.T (derived) and the table is also looked up;
  # `w` is also averaged outside its dot: both stay float, their ops'
  # frozen values go in the op store, and serve == train under jit.
  served = af.convert(q, IDS)
  assert isinstance(served.embed.embedding, nnx.Param)
  assert isinstance(served.w, nnx.Param)
  assert set(served.aqtr_frozen.get_value()) == {
    'dot_general0',
    'embed.dot_general0',
  }
  _same(_nnx_call(served, IDS), _nnx_call(q, IDS))
  # keep= still keeps a parameter's ops on the fly (nothing stored).
  kept = af.convert(q, IDS, keep='w')
  assert set(kept.aqtr_frozen.get_value()) == {'embed.dot_general0'}
  _same(_nnx_call(kept, IDS), _nnx_call(q, IDS))


def test_llama_on_a_2x4_mesh(llama):
  """Batch over 'data', kernels' last axis over 'model' (stock layers have
  no partitioning annotations: the shardings are put on the state)."""
  auto = (jax.sharding.AxisType.Auto,) * 2
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=auto)

  def put(x):
    last = 'model' if x.ndim >= 2 and x.shape[-1] % 4 == 0 else None
    spec = jax.P(*([None] * (x.ndim - 1)), last) if x.ndim else jax.P()
    return jax.device_put(x, jax.NamedSharding(mesh, spec))

  q = af.quantize(llama, [Rule('int8')])
  one = _nnx_call(q, IDS)
  nnx.update(q, jax.tree.map(put, nnx.state(q)))
  ids = jax.device_put(IDS, jax.NamedSharding(mesh, jax.P('data')))
  y = _nnx_call(q, ids)
  # One device vs the mesh: float summation order only (int8 dots are
  # exact; the scales, softmax and norms are not).
  np.testing.assert_allclose(y, one, rtol=0, atol=1e-5)
  served = af.convert(q, ids)  # checks serve == train on the mesh
  frozen = served.head.kernel.entries()['dot_general0_rhs']
  q8 = next(iter(frozen.values()))['rhs']['qvalue']
  assert q8.sharding.spec[-1] == 'model'  # follows the float kernel


# --- linen transformer (nn.scan over nn.remat blocks) ----------------------


def test_linen_transformer_int8_serve_and_float():
  m = sm.Transformer()
  v = jax.jit(m.init)(jax.random.key(1), IDS)
  q = af.quantize(m, [Rule('int8')])
  assert jax.tree.structure(jax.eval_shape(q.init, jax.random.key(1), IDS)) == (
    jax.tree.structure(v)
  )
  fwd, grad = _linen_jaxprs(q, v, IDS, lambda o: _lm_loss(o, IDS))
  assert _int8(_dots(fwd)) == 8 + 1
  assert _int8(_dots(grad)) == 9 + 7 + 2 * 9  # as for the nnx Llama
  y = jax.jit(q.apply)(v, IDS)
  served, sv = af.convert(q, IDS, variables=v, check=False)
  assert isinstance(sv['params']['layers']['q']['kernel'], FrozenBox)
  _same(jax.jit(served.apply)(sv, IDS), y)
  # Float rules: the very program of the unquantized model (so bit exact;
  # the nnx Llama test compares outputs).
  flt = af.quantize(m, [Rule('float')])
  assert str(jax.make_jaxpr(flt.apply)(v, IDS)) == str(
    jax.make_jaxpr(m.apply)(v, IDS)
  )


# --- linen CNN -------------------------------------------------------------


def test_linen_cnn_qat_convert_serve():
  m = sm.Cnn()
  v = jax.jit(m.init)(jax.random.key(0), IMG)
  conv = Rule(aqtr.fiddle.config('int8'), op='conv')  # a Fiddle config
  q = af.quantize(m, [conv, Rule('int8_weight_only')])
  rep = af.report(q, IMG, variables=v)
  assert [e.kind for e in rep.ops] == ['conv', 'conv', 'dot_general']

  def loss(out):
    return jnp.mean((out - 1.0) ** 2)

  fwd, grad = _linen_jaxprs(q, v, IMG, loss)
  assert _int8(_dots(fwd)) == 2  # the head is weight-only: a float dot
  assert _int8(_dots(grad)) == 3 * 2
  params = v['params']
  opt = optax.adam(1e-2)
  state = opt.init(params)

  @jax.jit
  def step(params, state):
    val, g = jax.value_and_grad(lambda p: loss(q.apply({'params': p}, IMG)))(
      params
    )
    up, state = opt.update(g, state)
    return optax.apply_updates(params, up), state, val

  losses = []
  for _ in range(5):
    params, state, val = step(params, state)
    losses.append(float(val))
  assert losses[-1] < losses[0]
  y = jax.jit(q.apply)({'params': params}, IMG)
  served, sv = af.convert(q, IMG, variables={'params': params})
  _same(jax.jit(served.apply)(sv, IMG), y)
  s = af.sizes(served, sv)
  assert s.float_kernel_bytes == 4 * (3 * 3 * 3 * 8 + 3 * 3 * 8 * 8 + 128 * 10)


# --- nnx MoE with lax.ragged_dot -------------------------------------------


def test_moe_ragged_dot_int8_and_serve():
  m = sm.Moe(4, nnx.Rngs(0))
  q = af.quantize(m, [Rule('int8', op='ragged_dot'), Rule(None)])
  rep = af.report(q, TOK)
  assert rep.quantized_paths() == ['ragged_dot0', 'ragged_dot1']
  fwd, _ = _nnx_jaxprs(q, TOK)
  assert _int8(_dots(fwd)) == 2
  y = _nnx_call(q, TOK)
  served = af.convert(q, TOK, check=False)
  _same(_nnx_call(served, TOK), y)  # experts quantized on the fly
  flt = af.quantize(m, [Rule('float')])
  assert str(_nnx_jaxprs(flt, TOK)[0]) == str(_nnx_jaxprs(m, TOK)[0])


# --- one Rule type for Pax and Flax ----------------------------------------


def test_pax_and_flax_share_rule_and_report():
  assert aqtr.pax.Rule is Rule
  cfg = aqtr.pax.templates.feed_forward(8, 16)
  _, rep = aqtr.pax.inject(cfg, [Rule('int8', op='einsum', weight=True)])
  assert type(rep) is type(
    af.report(
      af.quantize(sm.Cnn(), [Rule('int8')]),
      IMG,
      variables=jax.eval_shape(sm.Cnn().init, jax.random.key(0), IMG),
    )
  )
  assert rep.quantized_paths() == ['wi.einsum', 'wo.einsum']


# --- bad input -------------------------------------------------------------


def test_bad_regex_and_op_kind():
  with pytest.raises(ValueError, match=r'Rule.path .* is not a regex'):
    Rule('int8', path='layers/(')
  with pytest.raises(ValueError, match=r'Rule.op: unknown op kind'):
    Rule('int8', op='matmul')


def test_config_invalid_for_shapes_names_path_and_op(llama):
  q = af.quantize(llama, [Rule(aqtr.presets.int4_asym_weight_only(group=5))])
  with pytest.raises(ValueError, match=r'^layers/q/dot_general0 \(lax'):
    _nnx_call(q, IDS)


def test_already_quantized_and_serve_before_convert(llama):
  q = af.quantize(llama, [Rule('int8')])
  with pytest.raises(ValueError, match='already quantized'):
    af.quantize(q, [Rule('int8')])
  s = af.set_mode(nnx.clone(q), aqtr.Mode.SERVE)
  with pytest.raises(
    ValueError, match=r'layers/q/dot_general0.*SERVE.*convert'
  ):
    _nnx_call(s, IDS)


def test_rule_matching_nothing_warns_or_raises():
  m = sm.Cnn()
  v = jax.jit(m.init)(jax.random.key(0), IMG)
  q = af.quantize(m, [Rule('int8', op='ragged_dot'), Rule('int8')])
  with pytest.warns(UserWarning, match=r"rule 0 Rule\('int8', op=ragged_dot"):
    af.report(q, IMG, variables=v)
  with pytest.raises(ValueError, match='matched no op'):
    af.report(q, IMG, variables=v, strict=True)


def test_interception_that_cannot_run():
  class Jitted(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.ones((3, 3)))

    __call__ = jax.jit(lambda self, x: x @ self.w[...])

  with pytest.raises(TypeError, match='interception cannot run'):
    af.quantize(Jitted(), [Rule('int8')])
  with pytest.raises(TypeError, match='flax.linen or flax.nnx Module'):
    af.quantize(lambda x: x, [Rule('int8')])
