"""Tests for aqtr.core.sharding: the quantized dot on an 8-device host mesh.

Under auto and explicit axis types a sharded quantized dot is the same
computation as on one device: values and gradients are compared with the
single-device ones, bit for bit where every cross-device sum is an integer
(int8/fp8 dots accumulate in int32/f32 exactly at these sizes: |q| <= 127,
K = 32, so partial sums are exact) and within 1e-6 relative where a float
sum is involved: split across devices (weight-only dots, float passes,
K-sharded sub-channel tiles), or the sub-channel tiles' f32 sum, which LLVM
contracts into fused multiply-adds by the shape of each program's fusions
(XLA's default), so the sharded and the one-device program can differ by
1 ULP (measured: 9.5e-7 on outputs ~6, under XLA's default flags and the
test flags alike; equal only at -O0's fast instruction selection, which
never contracts). Under
`shard_map` each device runs the dot on its blocks: it is compared with the
same per-block computation on one device (`vmap` over the blocks; the
gradient of an operand that is invariant along the mesh axis is the sum of
the blocks' gradients).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import aqtr
from aqtr import presets, tilings
from aqtr.core import sharding

pytestmark = pytest.mark.skipif(
  jax.device_count() < 8, reason='needs 8 host devices (tests/conftest.py)'
)

DN = (((2,), (1,)), ((0,), (0,)))  # x [B, M, K] . w [B, K, N] -> [B, M, N]
X_SHAPE, W_SHAPE = (4, 8, 32), (4, 32, 16)


def _subchannel(tile_size: int = 0, tile_count: int = 0):
  """int8 with a sub-channel forward tiling (tile_count=n: local scales)."""
  cfg = presets.int8()
  t = tilings.SubChannel(tile_size=tile_size, tile_count=tile_count)
  fwd = dataclasses.replace(
    cfg.fwd,
    lhs=dataclasses.replace(cfg.fwd.lhs, tiling=t),
    rhs=dataclasses.replace(cfg.fwd.rhs, tiling=t),
  )
  return dataclasses.replace(cfg, fwd=fwd)


CONFIGS = {
  'int8': presets.int8(),
  'fp8': presets.fp8(),
  'sr': presets.fully_quantized(stochastic_rounding=True),
  'weight_only': presets.int8_weight_only(),
  'subchannel': _subchannel(tile_size=8),
}
EXACT = {'int8', 'fp8', 'sr'}

# name: (x spec, w spec, out spec, mesh axis, x axis, w axis, out axis);
# an axis None: the operand is not split (out None: partial sums).
LAYOUTS = {
  'batch': (P('a'), P('a'), P('a'), 'a', 0, 0, 0),
  'M': (P(None, 'b'), P(), P(None, 'b'), 'b', 1, None, 1),
  'N': (P(), P(None, None, 'b'), P(None, None, 'b'), 'b', None, 2, 2),
  'K': (P(None, None, 'b'), P(None, 'b'), P(), 'b', 2, 1, None),
}


def _data():
  kx, kw, kc = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, X_SHAPE)
  w = jax.random.normal(kw, W_SHAPE)
  ct = jax.random.normal(kc, (4, 8, 16))
  return x, w, ct


def _vjp(dot, x, w, ct):
  out, f = jax.vjp(dot, x, w)
  return (out,) + f(ct)


def _dot(cfg, out_sharding=None):
  key = jax.random.key(7)

  def dot(x, w):
    return aqtr.dot_general(x, w, DN, cfg, key=key, out_sharding=out_sharding)

  return dot


def _compare(got, want, exact: bool, what: str):
  for name, g, w in zip(('out', 'dx', 'dw'), got, want, strict=True):
    g, w = np.asarray(g), np.asarray(w)
    if exact:
      np.testing.assert_array_equal(g, w, err_msg=f'{what} {name}')
    else:
      np.testing.assert_allclose(
        g, w, rtol=1e-6, atol=1e-6 * np.abs(w).max(), err_msg=f'{what} {name}'
      )


def _split(a, axis, n):
  return jnp.stack(jnp.split(a, n, axis=axis))


def _join(blocks, axis):
  if axis is None:
    return blocks.sum(axis=0)
  return jnp.concatenate(list(blocks), axis=axis)


def _blockwise(cfg, layout, x, w, ct, n):
  """The shard_map computation, block by block on one device."""
  _, _, _, _, xa, wa, oa = layout
  xb = x if xa is None else _split(x, xa, n)
  wb = w if wa is None else _split(w, wa, n)
  cb = ct if oa is None else _split(ct, oa, n)
  in_axes = tuple(None if a is None else 0 for a in (xa, wa, oa))
  out, dx, dw = jax.jit(
    jax.vmap(lambda a, b, c: _vjp(_dot(cfg), a, b, c), in_axes=in_axes)
  )(xb, wb, cb)
  if oa is None:
    out = out.sum(axis=0)
  else:
    out = _join(out, oa)
  return out, _join(dx, xa), _join(dw, wa)


def _on_mesh(mesh, specs, *arrays):
  return [
    jax.device_put(a, NamedSharding(mesh, s))
    for a, s in zip(arrays, specs, strict=True)
  ]


MODES = ('auto', 'explicit', 'shard_map')
# Every preset, layout and mode at least once (the full product is slow).
FAST_CASES = [
  ('int8', 'M', 'explicit'),
  ('int8', 'K', 'shard_map'),
  ('fp8', 'N', 'auto'),
  ('sr', 'batch', 'shard_map'),
  ('weight_only', 'N', 'shard_map'),
  ('subchannel', 'K', 'explicit'),
]
SLOW_CASES = [
  c
  for c in ((p, lay, m) for p in CONFIGS for lay in LAYOUTS for m in MODES)
  if c not in FAST_CASES
]


def _check(cname: str, lname: str, mode: str):
  """One sharded vjp against its one-device counterpart."""
  x, w, ct = _data()
  cfg = CONFIGS[cname]
  layout = LAYOUTS[lname]
  xs, ws, os_, axis, *_ = layout
  types = (AxisType.Auto,) * 2 if mode == 'auto' else (AxisType.Explicit,) * 2
  mesh = jax.make_mesh((2, 4), ('a', 'b'), axis_types=types)
  if mode == 'shard_map':

    def local(a, b):
      out = _dot(cfg)(a, b)
      return jax.lax.psum(out, axis) if lname == 'K' else out

    dot = jax.shard_map(local, mesh=mesh, in_specs=(xs, ws), out_specs=os_)
    want = _blockwise(cfg, layout, x, w, ct, mesh.shape[axis])
  else:
    dot = _dot(cfg, os_ if lname == 'K' else None)
    want = jax.jit(lambda a, b, c: _vjp(_dot(cfg), a, b, c))(x, w, ct)
  with jax.set_mesh(mesh):
    args = _on_mesh(mesh, (xs, ws, os_), x, w, ct)
    got = jax.jit(lambda a, b, c: _vjp(dot, a, b, c))(*args)
    if mode == 'explicit':  # Each result has its primal's sharding.
      for g, a in zip(got, (args[2], *args[:2]), strict=True):
        assert jax.typeof(g).sharding.spec == jax.typeof(a).sharding.spec
  # A K-sharded sub-channel dot sums its tiles' f32 partials across devices.
  tiles_split = cname == 'subchannel' and lname == 'K'
  exact = cname in EXACT and mode != 'shard_map' and not tiles_split
  _compare(got, want, exact, f'{cname} {lname} {mode}')


@pytest.mark.parametrize('case', FAST_CASES, ids='-'.join)
def test_sharded_dot_equals_one_device(case):
  _check(*case)


@pytest.mark.slow
@pytest.mark.parametrize('case', SLOW_CASES, ids='-'.join)
def test_sharded_dot_equals_one_device_all(case):
  _check(*case)


def test_einsum_and_conv_take_out_sharding():
  mesh = jax.make_mesh((2, 4), ('a', 'b'))  # Explicit axes.
  x, w, _ = _data()
  cfg = presets.int8()
  with jax.set_mesh(mesh):
    xs, ws = _on_mesh(mesh, (P(None, None, 'b'), P(None, 'b')), x, w)
    got = jax.jit(
      lambda a, b: aqtr.einsum(
        'bmk,bkn->bnm', a, b, config=cfg, out_sharding=P('a', 'b')
      )
    )(xs, ws)
    assert jax.typeof(got).sharding.spec == P('a', 'b', None)
  want = aqtr.einsum('bmk,bkn->bnm', x, w, config=cfg)
  np.testing.assert_array_equal(got, want)

  img = jax.random.normal(jax.random.key(1), (2, 4, 4, 2))
  ker = jax.random.normal(jax.random.key(2), (2, 2, 2, 4))

  def conv(a, b, out_sharding):
    return aqtr.conv_general_dilated(
      a,
      b,
      (1, 1),
      'SAME',
      dimension_numbers=('NHWC', 'HWIO', 'NHWC'),
      config=cfg,
      out_sharding=out_sharding,
    )

  def loss(a, b, out_sharding=None):
    return jnp.sum(conv(a, b, out_sharding) ** 2)

  with jax.set_mesh(mesh):
    (ims, kes) = _on_mesh(mesh, (P('a'), P()), img, ker)
    got = jax.jit(
      jax.value_and_grad(lambda a, b: loss(a, b, P('a')), argnums=(0, 1))
    )(ims, kes)
    assert jax.typeof(got[1][0]).sharding.spec == jax.typeof(ims).sharding.spec
  want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(img, ker)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, r, rtol=1e-5)


def test_tile_split_across_devices_is_an_error():
  mesh = jax.make_mesh((8,), ('k',))
  x, w, _ = _data()
  with jax.set_mesh(mesh):
    xs, ws = _on_mesh(mesh, (P(None, None, 'k'), P(None, 'k')), x, w)
    with pytest.raises(ValueError, match=re.escape('lhs: contracting axis 2')):
      jax.jit(_dot(_subchannel(tile_size=8), out_sharding=P()))(xs, ws)
    # Local scales with fewer tiles than shards split them too; the error
    # names the operand and the mesh axis.
    with pytest.raises(ValueError, match='rhs: .* mesh axis k'):
      jax.jit(_dot(_subchannel(tile_count=4), out_sharding=P()))(x, ws)
    # Whole tiles per device (4 = 32 / 8) are fine.
    jax.jit(_dot(_subchannel(tile_size=4), out_sharding=P()))(xs, ws)


def test_mx_block_split_across_devices_is_an_error():
  """An MX block (32 values sharing a power-of-two scale) must not span
  devices: K = 32 over 8 devices leaves 4 values per device."""
  mesh = jax.make_mesh((8,), ('k',))
  x, w, _ = _data()
  with jax.set_mesh(mesh):
    xs, ws = _on_mesh(mesh, (P(None, None, 'k'), P(None, 'k')), x, w)
    with pytest.raises(ValueError, match='lhs: .* mesh axis k .* tile of 32'):
      jax.jit(_dot(presets.mxfp8(), out_sharding=P()))(xs, ws)


def test_local_shard_count_not_dividing_k_names_the_operand():
  x, w, _ = _data()  # K = 32.
  with pytest.raises(ValueError, match='^lhs: SubChannel.tile_count=3 '):
    _dot(_subchannel(tile_count=3))(x, w)


def test_mismatched_meshes_are_an_error():
  x, w, _ = _data()
  one = jax.make_mesh((8,), ('k',))
  two = jax.make_mesh((2, 4), ('a', 'b'))
  xs = jax.device_put(x, NamedSharding(one, P(None, None, 'k')))
  ws = jax.device_put(w, NamedSharding(two, P('a')))
  with pytest.raises(ValueError, match=r'^rhs .* axes \(a=2, b=4\), but lhs'):
    jax.jit(_dot(presets.int8()))(xs, ws)
  with jax.set_mesh(two):
    with pytest.raises(ValueError, match=r'^lhs .* axes \(k=8\), but the'):
      jax.jit(_dot(presets.int8()))(xs, ws)


def test_explicit_operands_without_a_mesh_set():
  """Explicitly sharded operands, no `jax.set_mesh`: run as lax does."""
  mesh = jax.make_mesh((8,), ('a',))
  x, w, ct = _data()
  xs = jax.device_put(x, NamedSharding(mesh, P(None, 'a')))  # M split.
  ws = jax.device_put(w, NamedSharding(mesh, P()))
  dot = _dot(presets.int8())
  got = jax.jit(lambda a, b: _vjp(dot, a, b, ct))(xs, ws)
  assert got[0].sharding.is_equivalent_to(xs.sharding, 3)
  assert got[1].sharding.is_equivalent_to(xs.sharding, 3)
  _compare(
    got, jax.jit(lambda a, b: _vjp(dot, a, b, ct))(x, w), True, 'no set_mesh'
  )


def test_ragged_dot_takes_out_sharding():
  """Token rows split over 8 devices, experts replicated: int8 values and
  gradients equal one device bit for bit (per-row and per-expert scales
  reduce only within a device); a mismatched mesh names the operand."""
  mesh = jax.make_mesh((8,), ('a',))
  kx, kw, kc = jax.random.split(jax.random.key(3), 3)
  x, ct = jax.random.normal(kx, (16, 32)), jax.random.normal(kc, (16, 8))
  w, sizes = jax.random.normal(kw, (2, 32, 8)), jnp.array([8, 8])

  def vjp(a, b, out_sharding=None):
    def dot(a, b):
      cfg = presets.int8()
      return aqtr.ragged_dot(a, b, sizes, cfg, out_sharding=out_sharding)

    out, f = jax.vjp(dot, a, b)
    return (out,) + f(ct)

  want = jax.jit(vjp)(x, w)
  with jax.set_mesh(mesh):
    xs, ws = _on_mesh(mesh, (P('a'), P()), x, w)
    got = jax.jit(lambda a, b: vjp(a, b, P('a')))(xs, ws)
    assert jax.typeof(got[0]).sharding.spec == P('a', None)
  _compare(got, want, True, 'ragged_dot')
  other = jax.make_mesh((2, 4), ('c', 'd'))
  wo = jax.device_put(w, NamedSharding(other, P()))
  with pytest.raises(ValueError, match=r'^rhs .* axes \(c=2, d=4\)'):
    jax.jit(vjp)(jax.device_put(x, NamedSharding(mesh, P('a'))), wo)


def _ops(compiled_text: str) -> list[str]:
  return [op for op, _, _ in sharding.collectives(compiled_text)]


def test_local_scales_leave_only_the_output_reduction():
  """K over 8 devices: SubChannel(tile_count=8) scales need no collective.

  Per-channel scales need a cross-device max (an all-reduce of the scales)
  before the int32 partial sums are reduced; one scale per shard leaves the
  output's partial-sum all-reduce alone.
  """
  mesh = jax.make_mesh((8,), ('k',))
  x = jnp.ones((16, 64))
  w = jnp.ones((64, 24))
  dn = (((1,), (0,)), ((), ()))
  found = {}
  with jax.set_mesh(mesh):
    xs, ws = _on_mesh(mesh, (P(None, 'k'), P('k')), x, w)
    for name, cfg in (
      ('channel', presets.int8()),
      ('local', _subchannel(tile_count=8)),
    ):
      f = jax.jit(
        lambda a, b, cfg=cfg: aqtr.dot_general(a, b, dn, cfg, out_sharding=P())
      )
      found[name] = _ops(f.lower(xs, ws).compile().as_text())
  assert found['local'] == ['all-reduce'], found
  assert len(found['channel']) > 1, found


def test_quantized_gather_moves_int8():
  """FSDP: x and w sharded over one axis; the dot gathers w as int8 + f32
  scales (a quarter of the f32 bytes and a scale row), values unchanged."""
  cfg = presets.int8()
  rhs = dataclasses.replace(cfg.fwd.rhs, quantized_gather=True)
  cfg = dataclasses.replace(cfg, fwd=dataclasses.replace(cfg.fwd, rhs=rhs))
  mesh = jax.make_mesh((8,), ('d',))
  x = jax.random.normal(jax.random.key(0), (64, 32))
  w = jax.random.normal(jax.random.key(1), (32, 48))
  dn = (((1,), (0,)), ((), ()))
  with jax.set_mesh(mesh):
    xs, ws = _on_mesh(mesh, (P('d'), P(None, 'd')), x, w)
    f = jax.jit(
      lambda a, b: aqtr.dot_general(a, b, dn, cfg, out_sharding=P('d'))
    )
    got = f(xs, ws)
    ops = sharding.collectives(f.lower(xs, ws).compile().as_text())
  gathers = [(dtype, n) for op, dtype, n in ops if op == 'all-gather']
  assert ('s8', 32 * 48) in gathers, ops
  assert sum(n for _, n in gathers) < 32 * 48 * 4 / 3, ops
  np.testing.assert_array_equal(got, aqtr.dot_general(x, w, dn, cfg))


def test_collectives_parses_hlo():
  text = (
    '%a = s8[4,8]{1,0} all-gather(%b), dimensions={0}\n'
    '%c = (f32[2]{0}, f32[3]{0}) all-reduce(%d, %e), to_apply=%sum\n'
    '%f = f32[2]{0} add(%g, %h)\n'
  )
  assert sharding.collectives(text) == [
    ('all-gather', 's8', 32),
    ('all-reduce', 'f32', 20),
  ]


_TOO_LONG = {
  'dot_general': lambda x, w, c, s: aqtr.dot_general(
    x, w, (((1,), (0,)), ((), ())), c, out_sharding=s
  ),
  'einsum': lambda x, w, c, s: aqtr.einsum(
    'mk,kn->mn', x, w, config=c, out_sharding=s
  ),
  'ragged_dot': lambda x, w, c, s: aqtr.ragged_dot(
    x, jnp.stack([w, w]), [4, 4], c, out_sharding=s
  ),
}


@pytest.mark.parametrize('config', ['float', 'int8'])
@pytest.mark.parametrize('op', sorted(_TOO_LONG))
def test_out_sharding_of_another_rank_is_named(op, config):
  # A 3-entry spec for a 2-D output was a bare AssertionError from lax.
  mesh = jax.make_mesh((8,), ('k',))
  x, w = jnp.ones((8, 64)), jnp.ones((64, 16))
  xs, ws = _on_mesh(mesh, (P('k', None), P()), x, w)
  cfg = getattr(presets, config)()
  with jax.set_mesh(mesh):
    with pytest.raises(
      ValueError, match=r'out_sharding .* has 3 entries, but the output is 2-D'
    ):
      jax.jit(lambda a, b: _TOO_LONG[op](a, b, cfg, P(None, None, 'k')))(xs, ws)
    if op == 'ragged_dot' and config == 'float':
      return  # lax.ragged_dot itself rejects explicit row shards.
    out = jax.jit(lambda a, b: _TOO_LONG[op](a, b, cfg, P('k', None)))(xs, ws)
    assert jax.typeof(out).sharding.spec == P('k', None)


def test_conv_out_sharding_of_another_rank_is_named():
  x, k = jnp.ones((2, 8, 8, 4)), jnp.ones((3, 3, 4, 8))
  for cfg in (presets.float(), presets.int8()):
    with pytest.raises(
      ValueError, match=r'has 5 entries, but the output is 4-D'
    ):
      aqtr.conv_general_dilated(
        x, k, (1, 1), 'SAME', dimension_numbers=('NHWC', 'HWIO', 'NHWC'),
        config=cfg, out_sharding=P(None, None, None, None, 'k'),
      )  # fmt: skip
