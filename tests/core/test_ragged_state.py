"""ragged_dot with state, stochastic rounding, sparsity and stored weights.

ragged_dot runs dot_general's plan (the group axis a batch axis of the
expert weights), so what dot_general takes it takes: per-expert
calibration state (delayed scaling with per-channel weights keeps one
amax history per expert and output channel), a PRNG key for stochastic
rounding, sparsity (with schedules), and the weights frozen as a QTensor
(serve == train bit for bit, with state too). What the geometry cannot
do is refused by one function, naming the field.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import aqtr
from aqtr import calibrations, sparsity, tilings, transforms
from aqtr.core import geometry
from aqtr.core.plan import Plan
from aqtr.core.ragged_dot import freeze_ragged, served_ragged_dot

SIZES = jnp.array([3, 0, 5])


def _operands(m=8, k=16, n=4, g=3):
  ks = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(ks[0], (m, k))
  w = jax.random.normal(ks[1], (g, k, n))
  ct = jax.random.normal(ks[2], (m, n))
  return x, w, ct


def _delayed(history=4):
  t = aqtr.TensorConfig(
    calibration=calibrations.DelayedScaling(history_length=history),
    tiling=tilings.PerChannel(),
  )
  return aqtr.DotGeneralConfig(fwd=aqtr.DotGeneralRaw(lhs=t, rhs=t))


def test_plan_is_the_dot_plan_with_a_group_batch_axis():
  x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
  w = jax.ShapeDtypeStruct((3, 16, 4), jnp.float32)
  p = Plan.create(x, w, aqtr.RAGGED, aqtr.presets.int8())
  assert p.ragged and p.out_shape == (8, 4)
  assert (p.lhs.form, p.rhs.form) == ('fk', 'kf')
  assert p.rhs.layout.batch == (0,) and p.lhs.layout.batch == ()
  from aqtr.core.slots import Slot  # noqa: PLC0415

  assert p.view(Slot.FWD_RHS) == (3, 1, 16, 4)  # One scale row per expert.
  assert p.view(Slot.DRHS_LHS) == (1, 1, 8, 4)  # g over all tokens.


def _reused_tiles_per_tensor_g():
  """Sub-channel forward reused by both gradients, g scaled per tensor."""
  t = tilings.SubChannel(tile_size=8)
  cfg = aqtr.presets.int8()
  fwd = dataclasses.replace(
    cfg.fwd,
    lhs=dataclasses.replace(cfg.fwd.lhs, tiling=t),
    rhs=dataclasses.replace(cfg.fwd.rhs, tiling=t),
  )
  g = aqtr.TensorConfig(tiling=tilings.PerTensor())
  return dataclasses.replace(
    cfg,
    fwd=fwd,
    dlhs=dataclasses.replace(cfg.dlhs, use_fwd_quant=True, lhs=g),
    drhs=dataclasses.replace(cfg.drhs, use_fwd_quant=True, lhs=g),
  )


@pytest.mark.parametrize(
  'cfg',
  [
    aqtr.presets.int8(),
    aqtr.presets.fp8(),
    aqtr.presets.fully_quantized(8, 8),
    _reused_tiles_per_tensor_g(),
  ],
  ids=['int8', 'fp8', 'fully_quantized', 'reused_tiles_per_tensor_g'],
)
def test_one_group_is_dot_general_bit_for_bit(cfg):
  # The same plan: one expert holding every token is dot_general, values
  # and both gradients (g's copies per reused tile share one per-tensor
  # scale in both).
  x, w, ct = _operands(m=10, k=16, n=8, g=1)
  dn = (((1,), (0,)), ((), ()))
  got = jax.vjp(lambda a, b: aqtr.ragged_dot(a, b, [10], cfg), x, w)
  want = jax.vjp(lambda a, b: aqtr.dot_general(a, b[0], dn, cfg), x, w)
  for a, b in zip((got[0], *got[1](ct)), (want[0], *want[1](ct)), strict=True):
    np.testing.assert_array_equal(a, b)


def test_delayed_scaling_keeps_one_history_per_expert_and_channel():
  x, w, ct = _operands()
  cfg = _delayed()
  s = aqtr.state.init(x, w, aqtr.RAGGED, cfg)
  assert s['fwd.rhs']['stats']['history'].shape == (4, 3, 1, 1, 4)

  @jax.jit
  def step(x, w, s):
    def loss(x, w, s):
      out, new = aqtr.ragged_dot(x, w, SIZES, cfg, state=s)
      return jnp.vdot(out, ct), new

    return jax.grad(loss, (0, 1, 2), has_aux=True)(x, w, s)

  (_, _, gs), new = step(x, w, s)
  s1 = aqtr.state.merge(new, gs)
  amax = jnp.max(jnp.abs(w), axis=1)  # [G, N]: per expert and channel.
  np.testing.assert_array_equal(
    s1['fwd.rhs']['stats']['history'][0].reshape(3, 4), amax
  )
  # The second step quantizes with the recorded history: the stored
  # weights frozen at that state serve the same output bit for bit.
  fwd = jax.jit(lambda x, w, s: aqtr.ragged_dot(x, w, SIZES, cfg, state=s))
  train, _ = fwd(x, w, s1)
  qw = aqtr.quantize_operand(w, aqtr.RAGGED, cfg, state=s1['fwd.rhs'])
  served, _ = jax.jit(
    lambda x, q, s: aqtr.ragged_dot(x, q, SIZES, cfg, state=s)
  )(x, qw, {'fwd.lhs': s1['fwd.lhs']})
  np.testing.assert_array_equal(served, train)


def test_state_of_another_shape_is_refused_naming_the_path():
  x, w, _ = _operands()
  cfg = _delayed()
  s = aqtr.state.init(x, w[:2], aqtr.RAGGED, cfg)  # Two experts, not 3.
  with pytest.raises(ValueError, match=r'fwd\.rhs: state of DelayedScaling'):
    aqtr.ragged_dot(x, w, SIZES, cfg, state=s)


def test_stochastic_rounding_follows_the_key():
  sr = aqtr.TensorConfig(rounding=aqtr.Stochastic())
  raw = aqtr.DotGeneralRaw(lhs=sr, rhs=sr)
  cfg = aqtr.DotGeneralConfig(fwd=raw, dlhs=raw, drhs=raw)  # Every pass.
  x, w, ct = _operands(m=16, k=32, n=8)
  gs = jnp.array([6, 0, 10])

  def grads(key):
    f = lambda a, b: aqtr.ragged_dot(a, b, gs, cfg, key=key)  # noqa: E731
    out, vjp = jax.vjp(f, x, w)
    return (out, *vjp(ct))

  a, b = grads(jax.random.key(1)), grads(jax.random.key(1))
  c = grads(jax.random.key(2))
  for u, v, z in zip(a, b, c, strict=True):
    np.testing.assert_array_equal(u, v)  # Deterministic for a key.
    assert not np.array_equal(u, z)  # Another key, other rounding.
  ref = jax.vjp(lambda a, b: lax.ragged_dot(a, b, gs), x, w)
  want = (ref[0], *ref[1](ct))
  for u, v in zip(a, want, strict=True):
    assert float(jnp.linalg.norm(u - v) / jnp.linalg.norm(v)) < 0.05


def test_sparsity_prunes_the_experts_as_dot_general_does():
  x, w, _ = _operands(k=16)
  t = aqtr.TensorConfig(sparsity=sparsity.NM(n=2, m=4))
  cfg = aqtr.DotGeneralConfig(
    fwd=aqtr.DotGeneralRaw(lhs=aqtr.TensorConfig(), rhs=t)
  )
  got = aqtr.ragged_dot(x, w, SIZES, cfg)
  want = jnp.concatenate(
    [
      aqtr.dot_general(x[:3], w[0], (((1,), (0,)), ((), ())), cfg),
      aqtr.dot_general(x[3:], w[2], (((1,), (0,)), ((), ())), cfg),
    ]
  )
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  # A schedule keeps the weights dense before start_step.
  later = dataclasses.replace(t, sparsity=sparsity.NM(n=2, m=4, start_step=2))
  cfg2 = dataclasses.replace(cfg, fwd=dataclasses.replace(cfg.fwd, rhs=later))
  s = aqtr.state.init(x, w, aqtr.RAGGED, cfg2)
  out, s = aqtr.ragged_dot(x, w, SIZES, cfg2, state=s)
  dense = aqtr.ragged_dot(x, w, SIZES, aqtr.presets.int8())
  np.testing.assert_array_equal(out, dense)
  assert float(s['fwd.rhs.sparsity']['stats']['step']) == 1.0


def test_frozen_experts_serve_train_bit_for_bit_without_gradient():
  x, w, _ = _operands()
  cfg = aqtr.presets.int8()
  train = jax.jit(lambda x, w: aqtr.ragged_dot(x, w, SIZES, cfg))(x, w)
  frozen = freeze_ragged(w, cfg)
  served = jax.jit(lambda x, f: served_ragged_dot(x, f, SIZES, cfg))(x, frozen)
  np.testing.assert_array_equal(served, train)
  q = aqtr.quantize_operand(w, aqtr.RAGGED, cfg)
  np.testing.assert_array_equal(q.qvalue, frozen['values'])
  dx = jax.grad(lambda a: aqtr.ragged_dot(a, q, SIZES, cfg).sum())(x)
  assert dx.shape == x.shape and bool(jnp.isfinite(dx).all())


def _rotating(cfg, rot, passes):
  """`cfg` requantizing every pass, `passes` rotated by `rot`."""
  out = {}
  for name in ('fwd', 'dlhs', 'drhs'):
    raw = dataclasses.replace(getattr(cfg, name), use_fwd_quant=False)
    if name in passes:
      raw = dataclasses.replace(
        raw,
        lhs=dataclasses.replace(raw.lhs, transform=rot),
        rhs=dataclasses.replace(raw.rhs, transform=rot),
      )
    out[name] = raw
  return dataclasses.replace(cfg, **out)


def test_rotations_of_fwd_and_dlhs_match_per_expert_dot_general():
  x, w, ct = _operands(m=8, k=32, n=16)
  cfg = _rotating(aqtr.presets.int8(), transforms.Hadamard(), ('fwd', 'dlhs'))
  dn = (((1,), (0,)), ((), ()))

  def ragged(x, w):
    return jnp.vdot(aqtr.ragged_dot(x, w, SIZES, cfg), ct)

  def per_expert(x, w):
    out = [
      aqtr.dot_general(x[:3], w[0], dn, cfg),
      aqtr.dot_general(x[3:], w[2], dn, cfg),
    ]
    return jnp.vdot(jnp.concatenate(out), ct)

  np.testing.assert_allclose(ragged(x, w), per_expert(x, w), rtol=1e-6)
  got = jax.grad(ragged)(x, w)
  np.testing.assert_allclose(got, jax.grad(per_expert)(x, w), atol=1e-5)


def test_what_the_geometry_cannot_do_is_refused_in_one_place():
  x, w, _ = _operands(m=8, k=16, n=8)
  cfg = aqtr.presets.int8()
  rot = _rotating(cfg, transforms.Hadamard(), ('drhs',))
  with pytest.raises(ValueError, match=r'config\.drhs\.lhs\.transform'):
    aqtr.ragged_dot(x, w, SIZES, rot)
  tiled = aqtr.TensorConfig(tiling=tilings.SubChannel(tile_size=4))
  bad = dataclasses.replace(cfg, drhs=dataclasses.replace(cfg.drhs, lhs=tiled))
  aqtr.ragged_dot(x, w, SIZES, bad)  # The forward serves.
  with pytest.raises(ValueError, match=r'config\.drhs\.lhs\.tiling'):
    jax.grad(lambda b: aqtr.ragged_dot(x, b, SIZES, bad).sum())(w)
  plan = Plan.create(x, w, aqtr.RAGGED, bad)
  with pytest.raises(ValueError, match='splits the token axis'):
    geometry.check_ragged(plan)
  with pytest.raises(ValueError, match='splits the token axis'):
    aqtr.validation.check_shapes(bad, x.shape, w.shape, aqtr.RAGGED)
  aqtr.validation.check_shapes(cfg, x.shape, w.shape, aqtr.RAGGED)
  other = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
  )
  with pytest.raises(ValueError, match='are not supported'):
    Plan.create(x, w, other, cfg)


def test_second_derivatives_raise_as_for_dot_general():
  x, w, _ = _operands()
  cfg = aqtr.presets.int8()

  def f(x):
    return jax.grad(lambda a: aqtr.ragged_dot(a, w, SIZES, cfg).sum())(x).sum()

  with pytest.raises(NotImplementedError, match='second-order'):
    jax.grad(f)(x)
