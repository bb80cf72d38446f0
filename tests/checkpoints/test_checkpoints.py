"""aqtr.checkpoints without the reference packages: round trips, bad input."""

import functools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import aqtr
from aqtr import checkpoints as ck
from aqtr.checkpoints import files
from aqtr.checkpoints.stored import Stored, pack, unpack
from aqtr.flax import convert, quantize
from aqtr.rules import Rule

X = jax.random.normal(jax.random.key(1), (3, 32))


class Mlp(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(32, 64, rngs=rngs)
    self.down = nnx.Linear(64, 16, use_bias=False, rngs=rngs)
    self.norm = nnx.LayerNorm(16, rngs=rngs)

  def __call__(self, x):
    return self.norm(self.down(jax.nn.relu(self.up(x))))


def _served(cfg):
  return convert(quantize(Mlp(nnx.Rngs(0)), [Rule(cfg, weight=True)]), X)


def _abstract():
  return nnx.eval_shape(lambda: Mlp(nnx.Rngs(0)))


CONFIGS = {
  'int4_channel_sym': lambda: aqtr.presets.int4_weight_only(),
  'int4_g16_asym': lambda: aqtr.presets.int4_asym_weight_only(group=16),
  'int8_channel': aqtr.presets.int8_weight_only,
}


_SERVED = {}


def served_by(name):
  if name not in _SERVED:  # One conversion per config for the module.
    _SERVED[name] = _served(CONFIGS[name]())
  return _SERVED[name]


@pytest.mark.parametrize(
  'name,fmt',
  [
    ('int4_channel_sym', 'compressed-tensors'),
    pytest.param('int8_channel', 'compressed-tensors', marks=pytest.mark.slow),
    ('int4_g16_asym', 'gptq'),
    ('int4_g16_asym', 'awq'),
  ],
)
def test_export_load_round_trip_serves_bit_for_bit(name, fmt, tmp_path):
  served = served_by(name)
  frozen, _ = ck.tree.read_frozen(served)
  info = ck.export(served, str(tmp_path), format=fmt)
  assert info['quantized'] == 2 and info['float'] == 3
  back = ck.load(_abstract(), str(tmp_path), X)
  np.testing.assert_array_equal(back(X), served(X))
  again, _ = ck.tree.read_frozen(back)
  for path, w in frozen.items():
    np.testing.assert_array_equal(again[path].dequant(), w.dequant())


def test_load_keeps_the_packed_size_no_float_kernel(tmp_path):
  ck.export(served_by('int4_channel_sym'), str(tmp_path))
  back = ck.load(_abstract(), str(tmp_path), X)
  for m in (back.up, back.down):
    (entry,) = jax.tree.leaves(m.kernel.get_raw_value())[:1]
    assert entry.dtype == jnp.uint8  # codes, 4 bits each, two per byte
    assert (
      entry.size * 2
      == m.kernel.get_metadata('kernel_shape')[0]
      * (m.kernel.get_metadata('kernel_shape')[1])
    )
  sizes = aqtr.flax.sizes(back)
  codes = (32 * 64 + 64 * 16) // 2
  assert sizes.frozen_kernel_bytes == codes + 4 * (64 + 16)  # + f32 scales
  # The stock layer's kernel is gone: nothing float of its shape is stored.
  floats = [
    v.get_value() for _, v in nnx.to_flat_state(nnx.state(back, nnx.Param))
  ]
  assert not any(getattr(a, 'shape', None) == (32, 64) for a in floats)


def test_linen_round_trip(tmp_path):
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(16, name='out')(nn.Dense(64, name='hidden')(x))

  q = quantize(Net(), [Rule(aqtr.presets.int4_weight_only())])
  v = q.init(jax.random.key(0), X)
  module, sv = convert(q, X, variables=v)
  ck.export(module, str(tmp_path), variables=sv, format='gptq')
  abstract = jax.eval_shape(Net().init, jax.random.key(0), X)
  m2, sv2 = ck.load(Net(), str(tmp_path), X, variables=abstract)
  np.testing.assert_array_equal(m2.apply(sv2, X), module.apply(sv, X))


def test_hf_names_and_config(folder):
  t = files.read(str(folder / files.WEIGHTS))
  assert {
    'up.weight_packed',
    'up.bias',
    'up.weight_zero_point',
    'down.weight_shape',
    'norm.weight',
    'norm.bias',
  } <= set(t)
  assert t['up.weight_shape'].tolist() == [64, 32]  # torch [out, in]
  cfg = json.load(open(folder / files.CONFIG))
  assert cfg['model_type'] == 'toy'
  assert cfg['quantization_config']['format'] == 'pack-quantized'


def test_user_name_map(tmp_path):
  served = served_by('int8_channel')
  names = {
    'up/kernel': 'a.w.weight',
    'up/bias': 'a.w.bias',
    'down/kernel': 'b.weight',
    'norm/scale': 'n.g',
    'norm/bias': 'n.b',
  }
  ck.export(served, str(tmp_path), names=names)
  assert 'a.w.weight_packed' in files.read(str(tmp_path / files.WEIGHTS))
  back = ck.load(_abstract(), str(tmp_path), X, names=names)
  np.testing.assert_array_equal(back(X), served(X))
  partial = dict(names)
  del partial['norm/bias']
  with pytest.raises(ck.CheckpointError, match=r'^norm/bias: the name map'):
    ck.export(served, str(tmp_path), names=partial)


@pytest.mark.parametrize('bits', [1, 2, 3, 4, 5, 7, 8])
def test_pack_unpack(bits):
  v = np.random.default_rng(bits).integers(0, 2**bits, (3, 37))
  for axis in (0, 1):
    p = pack(v, bits, axis)
    np.testing.assert_array_equal(unpack(p, bits, v.shape[axis], axis), v)


@pytest.fixture(scope='module')
def folder(tmp_path_factory):
  d = tmp_path_factory.mktemp('good')
  ck.export(served_by('int4_g16_asym'), str(d), config={'model_type': 'toy'})
  return d


def _broken(folder, tmp_path, edit_tensors=None, edit_config=None):
  t = dict(files.read(str(folder / files.WEIGHTS)))
  cfg = json.load(open(folder / files.CONFIG))
  if edit_tensors:
    edit_tensors(t)
  if edit_config:
    edit_config(cfg['quantization_config'])
  files.write(
    str(tmp_path / files.WEIGHTS), {k: np.array(v) for k, v in t.items()}
  )
  files.write_config(str(tmp_path), cfg)
  return str(tmp_path)


def _group(qc):
  return next(iter(qc['config_groups'].values()))['weights']


BAD = {
  'bits': (
    None,
    lambda qc: _group(qc).update(num_bits=8),
    r'^down\.weight_packed: shape \(16, 8\), but .*num_bits=8',
  ),
  'group size': (
    None,
    lambda qc: _group(qc).update(group_size=8),
    r'^down\.weight_scale: shape .*group_size=8',
  ),
  'shape': (
    lambda t: t.update({'up.weight_shape': np.array([64, 64])}),
    None,
    r'^up\.weight_packed: shape .* weight_shape',
  ),
  'missing tensor': (
    lambda t: t.pop('up.weight_scale'),
    None,
    r'^up\.weight_scale: missing tensor',
  ),
  'format': (
    None,
    lambda qc: qc.update(quant_method='bitsandbytes'),
    r"unknown format quant_method='bitsandbytes'",
  ),
  'unmapped': (
    lambda t: t.update({'extra.weight': np.ones(2, np.float32)}),
    None,
    r'^extra\.weight: no model parameter maps',
  ),
  'missing float': (
    lambda t: t.pop('norm.bias'),
    None,
    r'^norm\.bias: missing tensor \(for parameter norm/bias',
  ),
}


@pytest.mark.parametrize('case', sorted(BAD))
def test_bad_checkpoint_one_line(folder, tmp_path, case):
  et, ec, msg = BAD[case]
  d = _broken(folder, tmp_path, et, ec)
  with pytest.raises(ck.CheckpointError, match=msg) as e:
    ck.load(_abstract(), d, X)
  assert '\n' not in str(e.value)


def test_bad_gptq_and_stored():
  with pytest.raises(ck.CheckpointError, match='outside the signed 4-bit'):
    Stored(
      q=np.full((4, 2), 9, np.int8), scale=np.ones((1, 2)), bits=4, group=4
    )
  w = Stored(
    q=np.zeros((16, 8), np.int8),
    scale=np.ones((2, 8)),
    zero=np.full((2, 8), -8, np.int8),
    bits=4,
    group=8,
  )
  with pytest.raises(ck.CheckpointError, match='fc.qzeros: a zero point'):
    ck.Gptq().encode({'fc': w})
  t, qc = ck.Gptq(checkpoint_format='gptq_v2').encode({'fc': w})
  t['fc.g_idx'] = t['fc.g_idx'][::-1].copy()
  with pytest.raises(ck.CheckpointError, match=r'^fc\.g_idx: act-order'):
    ck.Gptq.from_config(qc).decode(t, qc)
  with pytest.raises(ck.CheckpointError, match=r'^fc: the awq layout'):
    ck.Awq().encode(
      {
        'fc': Stored(
          q=np.zeros((8, 8), np.int8), scale=np.ones((1, 8)), bits=8, group=8
        )
      }
    )
  with pytest.raises(ck.CheckpointError, match='argument format'):
    ck.layout('exl2')


@pytest.mark.slow
def test_docs_page_runs():
  import pathlib
  import re

  text = (pathlib.Path(__file__).parents[2] / 'docs/checkpoints.md').read_text()
  ns = {'__name__': 'docs_checkpoints'}
  for i, block in enumerate(re.findall(r'```python\n(.*?)```', text, re.S)):
    exec(compile(block, f'docs/checkpoints.md block {i}', 'exec'), ns)


def test_qlora_on_a_loaded_4bit_checkpoint_no_float_copy(tmp_path):
  import optax

  from aqtr import lora

  served = served_by('int4_g16_asym')
  ck.export(served, str(tmp_path))
  model = ck.qlora(_abstract(), str(tmp_path), lora.LoraConfig(rank=4), X)
  np.testing.assert_array_equal(model(X), served(X))  # B = 0: the base
  # The bases are the checkpoint's codes: no float kernel, anywhere.
  for m in (model.up, model.down):
    assert type(m.kernel).__name__ == 'LoraKernel'
  kernels = {(32, 64), (64, 16), (64, 32), (16, 64)}
  for a in jax.tree.leaves(nnx.state(model)):
    if jnp.issubdtype(jnp.result_type(a), jnp.floating):
      assert tuple(jnp.shape(a)) not in kernels, jnp.shape(a)
  opt = lora.nnx_optimizer(model, optax.adam(1e-3))

  @nnx.jit
  def step(model, opt):
    def loss(m):
      return jnp.mean((m(X) - 1.0) ** 2)

    value, grads = nnx.value_and_grad(
      loss, argnums=nnx.DiffState(0, lora.Adapter)
    )(model)
    opt.update(model, grads)
    return value

  losses = [float(step(model, opt)) for _ in range(5)]
  assert losses[-1] < losses[0]
  # Folded in float: the trained model's function (to rounding).
  flat = lora.merge(model, X, requantize=None)
  np.testing.assert_allclose(flat(X), model(X), rtol=1e-5, atol=1e-5)
  merged = lora.merge(model, X)  # Back in each weight's checkpoint format.
  again = tmp_path / 'merged'
  ck.export(merged, str(again))
  np.testing.assert_array_equal(
    ck.load(_abstract(), str(again), X)(X), merged(X)
  )


def test_export_warns_when_rules_can_quantize_activations(tmp_path):
  q = quantize(Mlp(nnx.Rngs(0)), [Rule(aqtr.presets.int8())])
  with pytest.warns(UserWarning, match=r'rule 0 .* \(argument rules\)'):
    ck.export(convert(q, X, check=False), str(tmp_path))


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    h = nn.Dense(64, name='up')(nn.LayerNorm(name='norm')(x))
    return x + nn.Dense(32, name='down')(jax.nn.relu(h)), None


class _Scanned(nn.Module):
  @nn.compact
  def __call__(self, x):
    stack = nn.scan(
      _Block,
      variable_axes={'params': 0},
      split_rngs={'params': True},
      length=3,
    )
    x, _ = stack(name='layers')(x, None)
    return nn.Dense(8, name='head')(x)


@functools.cache
def _scanned_served():
  cfg = aqtr.presets.int4_asym_weight_only(group=16)
  q = quantize(_Scanned(), [Rule(cfg, weight=True)])
  v = q.init(jax.random.key(0), X)
  module, sv = convert(q, X, variables=v, check=False)
  abstract = jax.eval_shape(_Scanned().init, jax.random.key(0), X)
  return module, sv, abstract


def test_stacked_layers_split_per_layer_and_stack_back(tmp_path):
  module, sv, abstract = _scanned_served()
  info = ck.export(module, str(tmp_path), variables=sv, format='gptq')
  assert info['quantized'] == 7  # 3 layers x (up, down) + head
  t = files.read(str(tmp_path / files.WEIGHTS))
  for i in range(3):
    assert {f'layers.{i}.up.qweight', f'layers.{i}.norm.weight'} <= set(t)
  assert t['layers.2.down.qweight'].shape == (64 // 8, 32)
  m2, sv2 = ck.load(_Scanned(), str(tmp_path), X, variables=abstract)
  np.testing.assert_array_equal(m2.apply(sv2, X), module.apply(sv, X))


@pytest.mark.slow
def test_stacked_layers_user_name_map(tmp_path):
  module, sv, abstract = _scanned_served()
  # A user map writes '{layer}' where the index goes.
  names = {
    'layers/up/kernel': 'model.layers.{layer}.fc1.weight',
    'layers/up/bias': 'model.layers.{layer}.fc1.bias',
    'layers/down/kernel': 'model.layers.{layer}.fc2.weight',
    'layers/down/bias': 'model.layers.{layer}.fc2.bias',
    'layers/norm/scale': 'model.layers.{layer}.ln.weight',
    'layers/norm/bias': 'model.layers.{layer}.ln.bias',
    'head/kernel': 'lm_head.weight',
    'head/bias': 'lm_head.bias',
  }
  user = tmp_path
  ck.export(module, str(user), variables=sv, names=names)
  assert 'model.layers.1.fc2.weight_packed' in files.read(
    str(user / files.WEIGHTS)
  )
  m3, sv3 = ck.load(_Scanned(), str(user), X, variables=abstract, names=names)
  np.testing.assert_array_equal(m3.apply(sv3, X), module.apply(sv, X))
  bad = dict(names, **{'layers/up/kernel': 'model.fc1.weight'})
  with pytest.raises(ck.CheckpointError, match=r'^layers/up/kernel: a stac'):
    ck.export(module, str(user), variables=sv, names=bad)


class _NnxBlock(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(32, 64, rngs=rngs)
    self.down = nnx.Linear(64, 32, rngs=rngs)

  def __call__(self, x):
    return x + self.down(jax.nn.relu(self.up(x)))


class _NnxScanned(nnx.Module):
  def __init__(self, rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return _NnxBlock(rngs)

    self.layers = make(rngs)
    self.head = nnx.Linear(32, 8, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(block, x):
      return block(x)

    return self.head(body(self.layers, x))


def test_nnx_vmapped_layers_round_trip(tmp_path):
  cfg = aqtr.presets.int4_weight_only()
  q = quantize(_NnxScanned(nnx.Rngs(0)), [Rule(cfg, weight=True)])
  served = convert(q, X, check=False)
  assert ck.export(served, str(tmp_path))['quantized'] == 7
  assert 'layers.2.up.weight_packed' in files.read(
    str(tmp_path / files.WEIGHTS)
  )
  model = nnx.eval_shape(lambda: _NnxScanned(nnx.Rngs(0)))
  np.testing.assert_array_equal(ck.load(model, str(tmp_path), X)(X), served(X))


@pytest.fixture(scope='module')
def gptq_folder(tmp_path_factory):
  d = tmp_path_factory.mktemp('gptq')
  ck.export(served_by('int4_g16_asym'), str(d), format='gptq')
  return d


BAD_GPTQ = {
  'bits': (
    lambda qc: qc.update(bits=8),
    r'^(up|down)\.scales: shape \(\d+, \d+\), but group_size=16 and bits=8',
  ),
  'group size': (
    lambda qc: qc.update(group_size=32),
    r'^(up|down)\.scales: shape .* group_size=32',
  ),
  'symmetry': (
    lambda qc: qc.update(sym=True),
    r'^(up|down)\.qzeros: quantization_config\.sym=true',
  ),
  'bits unsupported': (
    lambda qc: qc.update(bits=3),
    r'^quantization_config: bits=3; the gptq layout',
  ),
}


@pytest.mark.parametrize('case', sorted(BAD_GPTQ))
def test_bad_gptq_config_one_line(gptq_folder, tmp_path, case):
  edit, msg = BAD_GPTQ[case]
  d = _broken(gptq_folder, tmp_path, None, edit)
  with pytest.raises(ck.CheckpointError, match=msg) as e:
    ck.load(_abstract(), d, X)
  assert '\n' not in str(e.value)


def test_load_name_map_leaving_a_parameter_unmapped(folder):
  names = {
    'up/kernel': 'up.weight',
    'up/bias': 'up.bias',
    'down/kernel': 'down.weight',
    'norm/scale': 'norm.weight',
  }
  with pytest.raises(ck.CheckpointError, match=r'^norm/bias: the name map'):
    ck.load(_abstract(), str(folder), X, names=names)


def test_mxfp4_round_trip_and_int_layouts_refuse_it(tmp_path):
  cfg = aqtr.presets.mxfp4_weight_only()
  served = convert(
    quantize(nnx.Linear(64, 32, rngs=nnx.Rngs(0)), [Rule(cfg, weight=True)]),
    jnp.eye(64),
    check=False,
  )
  ck.export(served, str(tmp_path))
  model = nnx.eval_shape(lambda: nnx.Linear(64, 32, rngs=nnx.Rngs(0)))
  x = jax.random.normal(jax.random.key(0), (2, 64))
  np.testing.assert_array_equal(ck.load(model, str(tmp_path), x)(x), served(x))
  for fmt in ('gptq', 'awq'):
    with pytest.raises(ck.CheckpointError, match=rf'^weight: mxfp4 .* {fmt}'):
      ck.export(served, str(tmp_path / fmt), format=fmt)
