"""N:M sparse weights in Flax: TRAIN == SERVE from compressed weights."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax_cases import LinenMLP, NnxMLP, bitwise, digits

import aqtr
import aqtr.flax.linen as ql
import aqtr.flax.nnx as qn
from aqtr import sparsity
from aqtr.freezers import Mode


@pytest.mark.slow  # Fast version: test_linen_schedule_...
def test_flax_linen_train_equals_serve():
  cfg = aqtr.freezers.configure(
    sparsity.configure(aqtr.presets.int8(), rhs=sparsity.NM()),
    rhs='sparse_weights',
  )
  x, _ = digits(16)
  v = jax.jit(LinenMLP(cfg).init)(jax.random.key(0), x)
  serving = ql.convert(LinenMLP(cfg, Mode.CONVERT), v, x)
  leaves = jax.tree_util.tree_leaves_with_path(serving[ql.FROZEN])
  names = {jax.tree_util.keystr(p).split("'")[-2] for p, _ in leaves}
  assert names == {'values', 'indices', 'scale'}
  bitwise(
    jax.jit(LinenMLP(cfg, Mode.SERVE).apply)(serving, x),
    jax.jit(LinenMLP(cfg).apply)(v, x),
  )


class _Mlp(nn.Module):
  config: aqtr.DotGeneralConfig
  mode: Mode = Mode.TRAIN

  @nn.compact
  def __call__(self, x):
    dg = functools.partial(ql.DotGeneral, config=self.config, mode=self.mode)
    x = nn.relu(nn.Dense(16, dot_general_cls=dg)(x))
    return nn.Dense(8, dot_general_cls=dg)(x)


def test_linen_schedule_trains_converts_with_the_held_mask():
  nm = sparsity.NM(n=2, m=4, start_step=1, update_step=3)
  cfg = aqtr.freezers.configure(
    sparsity.configure(aqtr.presets.int8(), rhs=nm), rhs='sparse_weights'
  )
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
  model = _Mlp(cfg)
  v = model.init(jax.random.key(0), x)
  tx = optax.sgd(0.1)

  @jax.jit
  def step(v, opt):
    def loss(p, st):
      out, upd = model.apply({'params': p, ql.STATE: st}, x, mutable=[ql.STATE])
      return jnp.mean(out**2), upd[ql.STATE]

    (_, upd), (gp, gst) = jax.value_and_grad(loss, (0, 1), has_aux=True)(
      v['params'], v[ql.STATE]
    )
    u, opt = tx.update(gp, opt, v['params'])
    params = optax.apply_updates(v['params'], u)
    return {'params': params, ql.STATE: aqtr.state.merge_tree(upd, gst)}, opt

  opt = tx.init(v['params'])
  for _ in range(3):  # steps 0 (dense), 1 (mask made), 2 (held)
    v, opt = step(v, opt)
  stats = v[ql.STATE]['Dense_0']['DotGeneral_0']['stats']['fwd.rhs.sparsity']
  assert float(stats['step']) == 3  # next: step 3, held
  kernel = v['params']['Dense_0']['kernel']
  fresh = np.asarray(nm.mask(kernel[None], 1)[0])
  assert not (np.asarray(stats['mask'] > 0.5) == fresh).all()
  serving = ql.convert(_Mlp(cfg, Mode.CONVERT), v, x)
  kept = [
    jax.tree_util.keystr(p)
    for p, _ in jax.tree_util.tree_leaves_with_path(v[ql.STATE])
  ]
  served = [
    jax.tree_util.keystr(p)
    for p, _ in jax.tree_util.tree_leaves_with_path(serving.get(ql.STATE, {}))
  ]
  assert any('fwd.rhs.sparsity' in k for k in kept)
  assert not any('fwd.rhs.sparsity' in k for k in served)
  bitwise(
    _Mlp(cfg, Mode.SERVE).apply(serving, x),
    model.apply(v, x, mutable=[ql.STATE])[0],
  )


@pytest.mark.slow  # The linen twin runs by default.
def test_nnx_schedule_trains_converts_and_serves_bit_exact():
  nm = sparsity.NM(n=2, m=4, start_step=1, update_step=2)
  cfg = aqtr.freezers.configure(
    sparsity.configure(aqtr.presets.int8(), rhs=nm), rhs='sparse_weights'
  )
  x, _ = digits(16)
  m = NnxMLP(cfg, nnx.Rngs(0), hidden=32)
  m(x)  # Creates the ops' CalibState (the call is step 0: dense).
  diff = nnx.DiffState(0, nnx.Any(nnx.Param, qn.CalibState))
  opt = nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param)

  @nnx.jit
  def step(m, opt):
    grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2), argnums=diff)(m)
    qn.update_state(m, grads)
    opt.update(m, nnx.filter_state(grads, nnx.Param))

  for _ in range(2):  # steps 1 (mask made), 2 (held)
    step(m, opt)
  st = m.l1.dot_general.aqtr_state.get_value()['fwd.rhs.sparsity']
  assert float(st['step']) == 3
  saved = jax.tree.map(jnp.copy, nnx.state(m, qn.CalibState))
  want = m(x)  # TRAIN at the saved state (step 3: an update step).
  nnx.update(m, saved)
  qn.convert(m, x)
  bitwise(m(x), want)
