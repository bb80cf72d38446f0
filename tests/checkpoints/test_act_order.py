"""aqtr.checkpoints: act-order GPTQ (desc_act, a permuted g_idx) without
the reference packages (those checks: test_reference.py)."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import aqtr
from aqtr import checkpoints as ck
from aqtr.checkpoints import files
from aqtr.checkpoints.stored import Stored
from aqtr.rules import Rule


def _act_order(d_in=32, group=8):
  rng = np.random.default_rng(0)
  g_idx = (np.arange(d_in) // group)[rng.permutation(d_in)].astype(np.int32)
  w = Stored(
    q=rng.integers(-8, 8, (d_in, 8)).astype(np.int8),
    scale=(rng.random((d_in // group, 8)) + 0.5).astype(np.float32),
    zero=rng.integers(-7, 8, (d_in // group, 8)).astype(np.int8),
    bits=4,
    group=group,
    g_idx=g_idx,
  )
  return w, *ck.Gptq().encode({'fc': w})


BAD_G_IDX = {  # edit of (tensors, config) -> the one line
  'length': (
    lambda t, qc: t.update({'fc.g_idx': t['fc.g_idx'][:-1]}),
    r'^fc\.g_idx: shape \(31,\), but the codes have d_in=32 rows',
  ),
  'range': (
    lambda t, qc: t['fc.g_idx'].__setitem__(0, 4),
    r'^fc\.g_idx: groups span \[0, 4\], outside \[0, 3\]',
  ),
  'rows per group': (
    lambda t, qc: t['fc.g_idx'].__setitem__(
      np.flatnonzero(t['fc.g_idx'] == 1)[0], 0
    ),
    r'^fc\.g_idx: group 0 holds 9 rows, group_size=8 gives 8',
  ),
  'desc_act': (
    lambda t, qc: qc.update(desc_act=False),
    r'^fc\.g_idx: act-order rows .*\.desc_act is false',
  ),
  'dtype': (
    lambda t, qc: t.update({'fc.g_idx': t['fc.g_idx'].astype(np.float32)}),
    r'^fc\.g_idx: dtype float32',
  ),
}


@pytest.mark.parametrize('case', sorted(BAD_G_IDX))
def test_bad_act_order_g_idx_one_line(case):
  _, t, qc = _act_order()
  t = {k: v.copy() for k, v in t.items()}
  BAD_G_IDX[case][0](t, qc)
  with pytest.raises(ck.CheckpointError, match=BAD_G_IDX[case][1]) as e:
    ck.Gptq.from_config(qc).decode(t, qc)
  assert '\n' not in str(e.value)


def test_act_order_round_trip_and_other_layouts_refuse_it(tmp_path):
  w, t, qc = _act_order()
  assert qc['desc_act'] and not np.array_equal(
    t['fc.g_idx'], np.sort(t['fc.g_idx'])
  )
  (got,) = ck.Gptq.from_config(qc).decode(t, qc)[0].values()
  np.testing.assert_array_equal(got.g_idx, w.g_idx)
  np.testing.assert_array_equal(got.dequant(), w.dequant())
  for fmt, tensor in (('compressed-tensors', 'weight_g_idx'), ('awq', 'g_idx')):
    with pytest.raises(ck.CheckpointError, match=rf'^fc\.{tensor}: act-order'):
      ck.layout(fmt).encode({'fc': w})
  # Loaded into a linen Dense and served: the dequantized rows by group.
  files.write(str(tmp_path / files.WEIGHTS), t)
  files.write_config(str(tmp_path), {'quantization_config': qc})
  module = nn.Dense(8, use_bias=False)
  eye = jnp.eye(32)
  variables = jax.eval_shape(module.init, jax.random.key(0), eye)
  m, sv = ck.load(
    module,
    str(tmp_path),
    eye,
    variables=variables,
    names={'kernel': 'fc.weight'},
  )
  np.testing.assert_array_equal(m.apply(sv, eye), w.dequant())


def _folder(tmp_path, weights, rest=None):
  t, qc = ck.Gptq().encode(weights)
  t.update(rest or {})
  files.write(str(tmp_path / files.WEIGHTS), t)
  files.write_config(str(tmp_path), {'quantization_config': qc})
  return t


def _linear():
  return nnx.Linear(32, 8, use_bias=False, rngs=nnx.Rngs(0))


def test_qlora_serves_and_merges_an_act_order_base(tmp_path):
  from aqtr import lora

  w, _, _ = _act_order()
  _folder(tmp_path, {'fc': w})
  eye, fc = jnp.eye(32), lambda p: 'fc.weight'
  model = ck.qlora(
    nnx.eval_shape(_linear),
    str(tmp_path),
    lora.LoraConfig(rank=2),
    eye,
    names=fc,
  )
  np.testing.assert_array_equal(model(eye), w.dequant())  # B = 0
  # Merged (B = 0) in the kernel's own row order, requantized in
  # contiguous groups: the base's weights to within the new grid's step.
  merged = np.asarray(lora.merge(model, eye)(eye))
  err = np.linalg.norm(merged - w.dequant()) / np.linalg.norm(w.dequant())
  assert err < 0.1, err
  flat = np.asarray(lora.merge(model, eye, requantize=None)(eye))
  np.testing.assert_array_equal(flat, w.dequant())


class _Net(nnx.Module):
  def __init__(self, rngs):
    self.fc = nnx.Linear(32, 8, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.fc(x)


def test_rules_tiling_the_input_by_channel_groups_are_refused(tmp_path):
  w, _, _ = _act_order()
  _folder(tmp_path, {'fc': w})
  x = jax.random.normal(jax.random.key(0), (4, 32))
  model = nnx.eval_shape(lambda: _Net(nnx.Rngs(0)))
  mx = [Rule(aqtr.presets.mxfp8())]
  with pytest.raises(
    ck.CheckpointError, match=r'^fc/.*: act-order weight'
  ) as e:
    ck.load(model, str(tmp_path), x, rules=mx)
  assert '\n' not in str(e.value)
  # Inputs int8 per token (W8A8's): the same scales in any channel order.
  w8a8 = [Rule(aqtr.presets.int8())]
  served = ck.load(model, str(tmp_path), x, rules=w8a8)
  np.testing.assert_allclose(served(x), x @ w.dequant(), rtol=0.05, atol=0.5)


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return x + nn.Dense(32, use_bias=False, name='up')(x), None


class _Scanned(nn.Module):
  @nn.compact
  def __call__(self, x):
    stack = nn.scan(
      _Block,
      variable_axes={'params': 0},
      split_rngs={'params': True},
      length=2,
    )
    return stack(name='layers')(x, None)[0]


@pytest.mark.slow
def test_stacked_layers_one_act_order(tmp_path):
  w, _, _ = _act_order()
  w = dataclasses.replace(
    w,
    q=np.tile(w.q, (1, 4)),
    scale=np.tile(w.scale, (1, 4)),
    zero=np.tile(w.zero, (1, 4)),
  )
  plain = dataclasses.replace(w, g_idx=None)  # layer 0: groups in order
  t = _folder(tmp_path, {'layers.0.up': plain, 'layers.1.up': w})
  x = jax.random.normal(jax.random.key(0), (3, 32))
  abstract = jax.eval_shape(_Scanned().init, jax.random.key(0), x)
  m, sv = ck.load(_Scanned(), str(tmp_path), x, variables=abstract)
  kernels = jnp.stack([plain.dequant(), w.dequant()])
  want = _Scanned().apply(
    {'params': {'layers': {'up': {'kernel': kernels}}}}, x
  )
  np.testing.assert_allclose(m.apply(sv, x), want, rtol=1e-5, atol=1e-5)
  ck.export(m, str(tmp_path / 'again'), variables=sv, format='gptq')
  back = files.read(str(tmp_path / 'again' / files.WEIGHTS))
  assert sorted(back) == sorted(t)
  for k in t:
    np.testing.assert_array_equal(back[k], t[k])


def test_served_dot_gathers_the_input_by_the_stored_row_order():
  from aqtr.freezers import Mode, configure, lifecycle

  cfg = configure(aqtr.presets.int4_weight_only(), rhs='weights')
  dn = (((1,), (0,)), ((), ()))
  x = jax.random.normal(jax.random.key(0), (3, 32))
  w = jax.random.normal(jax.random.key(1), (32, 8))
  perm = jnp.asarray(np.random.default_rng(0).permutation(32), jnp.int32)
  call = lifecycle.DotCall(x, w[perm], dn, cfg)
  entry = lifecycle.run(call, Mode.CONVERT).frozen
  plain = lifecycle.run(
    lifecycle.DotCall(x[:, perm], 0 * w, dn, cfg), Mode.SERVE, frozen=entry
  ).out
  entry['rhs']['perm'] = perm  # Rows stored in the order perm.
  got = lifecycle.run(
    lifecycle.DotCall(x, 0 * w, dn, cfg), Mode.SERVE, frozen=entry
  ).out
  np.testing.assert_array_equal(got, plain)
  entry['rhs']['perm'] = perm[:-1]
  with pytest.raises(lifecycle.FreezerError, match="'perm' has shape"):
    lifecycle.run(
      lifecycle.DotCall(x, 0 * w, dn, cfg), Mode.SERVE, frozen=entry
    )
