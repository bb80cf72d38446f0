"""aqtr.checkpoints against the reference implementations (extra
`checkpoints-reference`: torch CPU, safetensors, compressed-tensors).

compressed-tensors' own decompressor (`PackedQuantizationCompressor`) and
its AutoAWQ converter read aqtr's files; its compressor writes a
checkpoint from weights aqtr never saw, which aqtr loads and serves. The
GPTQ layout has no installable CPU reference (AutoGPTQ / GPTQModel build
CUDA kernels): `_gptq_reference` transcribes AutoGPTQ's torch dequant.
"""

import importlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from aqtr import checkpoints as ck
from aqtr import presets as aqtr_presets
from aqtr.checkpoints import files
from aqtr.flax import convert, quantize
from aqtr.ptq import quantize as ptq_quantize
from aqtr.rules import Rule

_REFERENCES = (
  'torch',
  'safetensors.torch',
  'compressed_tensors.compressors.pack_quantized',
  'compressed_tensors.quantization',
  'compressed_tensors.entrypoints.convert.converters.autoawq',
)


@pytest.fixture(autouse=True, scope='module')
def _references():
  """Skips the module without the extra, when it runs (see _Lazy)."""
  for name in _REFERENCES:
    pytest.importorskip(name)


class _Lazy:
  """A module imported at its first attribute access, not at collection.

  torch and compressed-tensors take ~5 s of CPU to import: imported at
  module level, every pytest-xdist worker paid it while collecting (and
  held torch in memory), not only the one that runs this module.
  """

  def __init__(self, name):
    self._name = name

  def __getattr__(self, attr):
    if attr.startswith('_'):  # pytest's collection probes `__test__`, ...
      raise AttributeError(attr)
    return getattr(importlib.import_module(self._name), attr)


torch = _Lazy('torch')
st = _Lazy('safetensors.torch')
ct_pack = _Lazy('compressed_tensors.compressors.pack_quantized')
ct_quant = _Lazy('compressed_tensors.quantization')
ct_awq = _Lazy(_REFERENCES[4])

D_IN, D_OUT = 64, 32
EYE = jnp.eye(D_IN)


def _write_compressed(folder, out, scheme, fmt, meta=False):
  """Writes the reference compressor's `out` as a compressed-tensors
  checkpoint of format `fmt`; (its tensors, its quantization config)."""
  tensors = {f'fc.{k}': v.contiguous() for k, v in out.items()}
  extra = {'metadata': {'format': 'pt'}} if meta else {}
  st.save_file(tensors, str(folder / files.WEIGHTS), **extra)
  qc = ct_quant.QuantizationConfig(
    config_groups={'group_0': scheme},
    format=fmt,
    quantization_status='compressed',
  ).to_dict()
  json.dump({'quantization_config': qc}, open(folder / files.CONFIG, 'w'))
  return tensors, qc


def _linear():
  return nnx.Linear(D_IN, D_OUT, use_bias=False, rngs=nnx.Rngs(0))


def _weights(served):
  """aqtr's dequantized weight [d_in, d_out]: the served layer on I."""
  return np.asarray(served(EYE))


def _ct_reference(folder, module=''):
  """compressed-tensors' decompression of a pack-quantized folder."""
  qc = json.load(open(folder / files.CONFIG))['quantization_config']
  cfg = ct_quant.QuantizationConfig.model_validate(qc)
  (scheme,) = cfg.config_groups.values()
  t = st.load_file(str(folder / files.WEIGHTS))
  prefix = f'{module}.' if module else ''
  sd = {
    k[len(prefix) :]: v
    for k, v in t.items()
    if k.startswith(prefix) and k.count('.') == prefix.count('.')
  }
  return ct_pack.PackedQuantizationCompressor.decompress(sd, scheme)['weight']


def _gptq_reference(folder, module=''):
  """AutoGPTQ's dequant (QuantLinear, checkpoint_format 'gptq'), in torch."""
  qc = json.load(open(folder / files.CONFIG))['quantization_config']
  t = st.load_file(str(folder / files.WEIGHTS))
  p = f'{module}.' if module else ''
  bits = qc['bits']
  wf = torch.arange(0, 32, bits, dtype=torch.int32)
  qz, qw = t[f'{p}qzeros'], t[f'{p}qweight']
  zeros = torch.bitwise_right_shift(qz.unsqueeze(2), wf.view(1, 1, -1))
  zeros = torch.bitwise_and(zeros, 2**bits - 1).reshape(qz.shape[0], -1) + 1
  w = torch.bitwise_right_shift(qw.unsqueeze(1), wf.view(1, -1, 1))
  w = torch.bitwise_and(w, 2**bits - 1).reshape(-1, qw.shape[1])
  g = t[f'{p}g_idx'].long()
  w = t[f'{p}scales'][g] * (w - zeros[g]).to(t[f'{p}scales'].dtype)
  return w.T  # torch's [d_out, d_in]


def _awq_reference(folder, module=''):
  """AutoAWQ GEMM -> compressed-tensors (its converter), decompressed."""
  qc = json.load(open(folder / files.CONFIG))['quantization_config']
  conv = ct_awq.AutoAWQConverter.from_autoawq_config(qc)
  t = conv.process(st.load_file(str(folder / files.WEIGHTS)))
  (scheme,) = conv.update_config(None).config_groups.values()
  p = f'{module}.' if module else ''
  sd = {k[len(p) :]: v for k, v in t.items() if k.startswith(p)}
  return ct_pack.PackedQuantizationCompressor.decompress(sd, scheme)['weight']


def _cfg(bits, sym, group):
  w = ck.Stored(
    q=np.zeros((D_IN, 1), np.int8),
    scale=np.ones((D_IN // (group or D_IN), 1), np.float32),
    zero=None if sym else np.zeros((D_IN // (group or D_IN), 1), np.int8),
    bits=bits,
    group=group or D_IN,
  )
  return ck.tree.config_for(w)  # aqtr's int numerics on this grid


SLOW = pytest.mark.slow
CASES = [  # bits, symmetric, group (0: per channel)
  (4, False, 16),
  pytest.param(8, True, 0, marks=SLOW),
  pytest.param(4, True, 16, marks=SLOW),
  pytest.param(4, True, 0, marks=SLOW),
  pytest.param(4, False, 0, marks=SLOW),
  pytest.param(8, False, 32, marks=SLOW),
]


@pytest.mark.parametrize('bits,sym,group', CASES)
def test_reference_decompresses_aqtr_export_bit_for_bit(
  bits, sym, group, tmp_path
):
  served = convert(quantize(_linear(), [Rule(_cfg(bits, sym, group))]), EYE)
  ck.export(served, str(tmp_path), names=lambda p: 'fc.weight')
  ref = _ct_reference(tmp_path, 'fc').numpy().T
  np.testing.assert_array_equal(ref, _weights(served))


_GPTQ = {}


def gptq_served(sym):
  """GPTQ with act-order (static groups) on a toy layer: aqtr's solver."""
  if sym not in _GPTQ:  # One solve per grid for the module.
    xs = [jax.random.normal(jax.random.key(i), (64, D_IN)) for i in range(2)]
    _GPTQ[sym], _ = ptq_quantize(
      _linear(), [Rule(_cfg(4, sym, 16))], xs, method='gptq', act_order=True
    )
  return _GPTQ[sym]


@pytest.mark.parametrize('sym', [False, pytest.param(True, marks=SLOW)])
@pytest.mark.parametrize('fmt', ['compressed-tensors', 'gptq', 'awq'])
def test_act_order_gptq_export_matches_references(sym, fmt, tmp_path):
  served = gptq_served(sym)
  ck.export(served, str(tmp_path), format=fmt, names=lambda p: 'fc.weight')
  ref = {
    'compressed-tensors': _ct_reference,
    'gptq': _gptq_reference,
    'awq': _awq_reference,
  }[fmt](tmp_path, 'fc')
  np.testing.assert_array_equal(ref.numpy().T, _weights(served))


def _autogptq_pack(u, uz, bits):
  """AutoGPTQ's `QuantLinear.pack` (checkpoint_format 'gptq'), transcribed:
  unsigned codes u [d_in, d_out] -> qweight, 32 / bits per int32 along
  d_in; zero points uz [groups, d_out] minus one -> qzeros along d_out."""
  u, z = u.astype(np.uint32), (uz - 1).astype(np.uint32)
  p = 32 // bits
  qweight = np.zeros((u.shape[0] // p, u.shape[1]), np.uint32)
  for row in range(qweight.shape[0]):
    for j in range(row * p, row * p + p):
      qweight[row] |= u[j] << (bits * (j - row * p))
  qzeros = np.zeros((z.shape[0], z.shape[1] // p), np.uint32)
  for col in range(qzeros.shape[1]):
    for j in range(col * p, col * p + p):
      qzeros[:, col] |= z[:, j] << (bits * (j - col * p))
  return qweight.astype(np.int32), qzeros.astype(np.int32)


def _act_order_checkpoint(folder, sym, scale_dtype, group=16, bits=4):
  """An act-order (desc_act) GPTQ checkpoint as AutoGPTQ writes one: its
  g_idx is `(i // group)[invperm]` for the solve order perm."""
  rng = np.random.default_rng(0)
  perm = rng.permutation(D_IN)
  g_idx = (np.arange(D_IN) // group)[np.argsort(perm)].astype(np.int32)
  n, top = D_IN // group, 2**bits
  u = rng.integers(0, top, (D_IN, D_OUT))
  uz = (
    np.full((n, D_OUT), top // 2) if sym else rng.integers(1, top, (n, D_OUT))
  )
  qweight, qzeros = _autogptq_pack(u, uz, bits)
  tensors = {
    'fc.qweight': torch.from_numpy(qweight),
    'fc.qzeros': torch.from_numpy(qzeros),
    'fc.scales': torch.rand(n, D_OUT, dtype=torch.float32).to(scale_dtype),
    'fc.g_idx': torch.from_numpy(g_idx),
  }
  st.save_file(tensors, str(folder / files.WEIGHTS))
  qc = {
    'quant_method': 'gptq',
    'bits': bits,
    'group_size': group,
    'desc_act': True,
    'sym': sym,
    'checkpoint_format': 'gptq',
  }
  json.dump({'quantization_config': qc}, open(folder / files.CONFIG, 'w'))
  return tensors


@pytest.mark.parametrize(
  'sym,dtype',
  [(False, 'float32'), pytest.param(True, 'float16', marks=SLOW)],
)
def test_act_order_gptq_checkpoint_loads_serves_and_exports(
  sym, dtype, tmp_path
):
  tensors = _act_order_checkpoint(tmp_path, sym, getattr(torch, dtype))
  ref = _gptq_reference(tmp_path, 'fc').float().numpy().T
  model = nnx.eval_shape(_linear)
  served = ck.load(model, str(tmp_path), EYE, names=lambda p: 'fc.weight')
  got = _weights(served)
  if dtype == 'float32':
    np.testing.assert_array_equal(ref, got)
  else:  # The reference computes (u - z) * s in float16; aqtr in f32.
    np.testing.assert_array_equal(ref, got.astype(np.float16))
  x = jax.random.normal(jax.random.key(0), (3, D_IN))
  np.testing.assert_allclose(served(x), x @ got, rtol=1e-5, atol=1e-5)
  # Packed codes, the scales and the row order: no float kernel.
  leaves = jax.tree.leaves(nnx.state(served))
  assert not any(jnp.shape(a) == (D_IN, D_OUT) for a in leaves)
  perm = [a for a in leaves if a.dtype == jnp.int32]
  assert [a.shape for a in perm] == [(D_IN,)]
  # Exported again: the checkpoint's tensors, and the reference serves
  # aqtr's weights; loaded back: the same outputs bit for bit.
  again = tmp_path / 'again'
  ck.export(
    served,
    str(again),
    format='gptq',
    names=lambda p: 'fc.weight',
    scale_dtype=dtype,
  )
  mine = st.load_file(str(again / files.WEIGHTS))
  assert sorted(mine) == sorted(tensors)
  for k in tensors:
    assert torch.equal(mine[k], tensors[k]), k
  qc = json.load(open(again / files.CONFIG))['quantization_config']
  assert qc['desc_act'] is True
  back = ck.load(model, str(again), EYE, names=lambda p: 'fc.weight')
  np.testing.assert_array_equal(back(x), served(x))
  np.testing.assert_array_equal(
    _gptq_reference(again, 'fc').float().numpy().T, ref
  )


def _reference_checkpoint(folder, bits, sym, group, scale_dtype):
  """A checkpoint compressed-tensors' compressor writes from torch weights."""
  torch.manual_seed(0)
  w = torch.randn(D_OUT, D_IN, dtype=torch.float32)
  args = ct_quant.QuantizationArgs(
    num_bits=bits,
    symmetric=sym,
    strategy='group' if group else 'channel',
    group_size=group or None,
  )
  shaped = w.reshape(D_OUT, -1, group) if group else w.reshape(D_OUT, 1, -1)
  lo, hi = shaped.amin(-1), shaped.amax(-1)
  scale, zp = ct_quant.utils.helpers.calculate_qparams(lo, hi, args)
  scheme = ct_quant.QuantizationScheme(targets=['Linear'], weights=args)
  sd = {'weight': w, 'weight_scale': scale.to(scale_dtype)}
  if not sym:
    sd['weight_zero_point'] = zp
  out = ct_pack.PackedQuantizationCompressor.compress(sd, scheme)
  _write_compressed(folder, out, scheme, 'pack-quantized', meta=True)
  return _ct_reference(folder, 'fc')


@pytest.mark.parametrize(
  'bits,sym,group,dtype',
  [
    (4, True, 16, 'float32'),
    (4, False, 16, 'bfloat16'),
    pytest.param(4, False, 32, 'float32', marks=SLOW),
    pytest.param(8, True, 0, 'float32', marks=SLOW),
  ],
)
def test_reference_checkpoint_loads_and_serves(
  bits, sym, group, dtype, tmp_path
):
  tdt = getattr(torch, dtype)
  ref = _reference_checkpoint(tmp_path, bits, sym, group, tdt)
  model = nnx.eval_shape(_linear)
  served = ck.load(model, str(tmp_path), EYE, names=lambda p: 'fc.weight')
  got = _weights(served)
  if dtype == 'float32':
    np.testing.assert_array_equal(ref.numpy().T, got)
  else:  # The reference rounds (q - z) * s to bfloat16; aqtr keeps f32.
    np.testing.assert_array_equal(
      ref.float().numpy().T,
      np.asarray(jnp.asarray(got, jnp.bfloat16), np.float32),
    )
  # Re-exported by aqtr: the same bytes within 2 % (here: identical data).
  out = tmp_path / 'again'
  ck.export(served, str(out), names=lambda p: 'fc.weight', scale_dtype=dtype)
  a = (tmp_path / files.WEIGHTS).stat().st_size
  b = (out / files.WEIGHTS).stat().st_size
  assert abs(a - b) <= 0.02 * a, (a, b)
  mine, theirs = (
    st.load_file(str(out / files.WEIGHTS)),
    st.load_file(str(tmp_path / files.WEIGHTS)),
  )
  for k in theirs:
    assert torch.equal(mine[k], theirs[k]), k


def _mx_scheme(qc):
  cfg = ct_quant.QuantizationConfig.model_validate(qc)
  (scheme,) = cfg.config_groups.values()
  return scheme


def test_reference_decompresses_aqtr_mxfp4_export_bit_for_bit(tmp_path):
  from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor

  cfg = aqtr_presets.mxfp4_weight_only()
  served = convert(quantize(_linear(), [Rule(cfg, weight=True)]), EYE)
  ck.export(served, str(tmp_path), names=lambda p: 'fc.weight')
  qc = json.load(open(tmp_path / files.CONFIG))['quantization_config']
  assert qc['format'] == 'mxfp4-pack-quantized'
  t = st.load_file(str(tmp_path / files.WEIGHTS))
  sd = {k[len('fc.') :]: v for k, v in t.items()}
  ref = MXFP4PackedCompressor.decompress(sd, _mx_scheme(qc))['weight']
  np.testing.assert_array_equal(ref.float().numpy().T, _weights(served))
  back = ck.load(
    nnx.eval_shape(_linear), str(tmp_path), EYE, names=lambda p: 'fc.weight'
  )
  np.testing.assert_array_equal(_weights(back), _weights(served))


def test_reference_mxfp4_checkpoint_loads_and_serves(tmp_path):
  from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor

  torch.manual_seed(0)
  w = torch.randn(D_OUT, D_IN, dtype=torch.float32)
  args = ct_quant.QuantizationArgs(
    num_bits=4,
    type='float',
    strategy='group',
    group_size=32,
    symmetric=True,
    scale_dtype=torch.uint8,
    zp_dtype=torch.uint8,
  )
  g = w.reshape(D_OUT, -1, 32)
  scale, _ = ct_quant.utils.helpers.calculate_qparams(
    g.amin(-1), g.amax(-1), args
  )
  scheme = ct_quant.QuantizationScheme(targets=['Linear'], weights=args)
  out = MXFP4PackedCompressor.compress(
    {'weight': w, 'weight_scale': scale}, scheme
  )
  tensors, _ = _write_compressed(tmp_path, out, scheme, 'mxfp4-pack-quantized')
  ref = MXFP4PackedCompressor.decompress(out, scheme)['weight']
  served = ck.load(
    nnx.eval_shape(_linear), str(tmp_path), EYE, names=lambda p: 'fc.weight'
  )
  np.testing.assert_array_equal(ref.float().numpy().T, _weights(served))
  # Exported again by aqtr: the reference's tensors, byte for byte.
  again = tmp_path / 'again'
  ck.export(served, str(again), names=lambda p: 'fc.weight')
  mine = st.load_file(str(again / files.WEIGHTS))
  assert sorted(mine) == sorted(tensors)
  for k in tensors:
    assert torch.equal(mine[k], tensors[k]), k


def _nv_reference(tensors, qc, module='fc'):
  """compressed-tensors' NVFP4 dequantization: float32 (its `dequantize`
  with the global scale, d / g in float32) and its decompressor's
  (`NVFP4PackedCompressor.decompress`, rounded to bfloat16), [d_in, d_out]."""
  from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
  from compressed_tensors.compressors.nvfp4.helpers import (
    unpack_fp4_from_uint8,
  )
  from compressed_tensors.quantization.lifecycle.forward import dequantize

  scheme = _mx_scheme(qc)
  sd = {k[len(module) + 1 :]: v for k, v in tensors.items()}
  m, n = sd['weight_packed'].shape
  f32 = dequantize(
    x_q=unpack_fp4_from_uint8(sd['weight_packed'], m, 2 * n, torch.float32),
    scale=sd['weight_scale'].to(torch.float32),
    args=scheme.weights,
    global_scale=sd['weight_global_scale'],
    dtype=torch.float32,
  )
  bf16 = NVFP4PackedCompressor.decompress(sd, scheme)['weight']
  return f32.numpy().T, bf16.float().numpy().T


def _as_bf16(a):
  return np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32)


def test_reference_nvfp4_checkpoint_loads_serves_and_exports(tmp_path):
  from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
  from compressed_tensors.quantization.utils.helpers import generate_gparam

  torch.manual_seed(0)
  w = torch.randn(D_OUT, D_IN, dtype=torch.float32)
  scheme = ct_quant.preset_name_to_scheme('NVFP4A16', ['Linear'])
  gs = generate_gparam(w.min(), w.max())
  g = w.reshape(D_OUT, -1, 16)
  scale, _ = ct_quant.utils.helpers.calculate_qparams(
    g.amin(-1), g.amax(-1), scheme.weights, global_scale=gs
  )
  out = NVFP4PackedCompressor.compress(
    {'weight': w, 'weight_scale': scale, 'weight_global_scale': gs}, scheme
  )
  tensors, qc = _write_compressed(tmp_path, out, scheme, 'nvfp4-pack-quantized')
  f32, bf16 = _nv_reference(tensors, qc)
  served = ck.load(
    nnx.eval_shape(_linear), str(tmp_path), EYE, names=lambda p: 'fc.weight'
  )
  got = _weights(served)
  np.testing.assert_array_equal(f32, got)
  np.testing.assert_array_equal(bf16, _as_bf16(got))
  # Exported again by aqtr: the reference's tensors, byte for byte (the
  # same e4m3 block scales and global scale).
  again = tmp_path / 'again'
  ck.export(served, str(again), names=lambda p: 'fc.weight')
  mine = st.load_file(str(again / files.WEIGHTS))
  assert sorted(mine) == sorted(tensors)
  for k in tensors:
    assert torch.equal(mine[k], tensors[k]), k


def test_reference_dequantizes_aqtr_nvfp4_export_bit_for_bit(tmp_path):
  cfg = ck.tree.config_for(  # aqtr's NVFP4 weights (presets.nvfp4's)
    ck.Stored(
      q=np.zeros((16, 1), np.uint8),
      scale=np.ones((1, 1), np.float32),
      group=16,
      kind='nvfp4',
    )
  )
  served = convert(quantize(_linear(), [Rule(cfg, weight=True)]), EYE)
  ck.export(served, str(tmp_path), names=lambda p: 'fc.weight')
  qc = json.load(open(tmp_path / files.CONFIG))['quantization_config']
  assert qc['format'] == 'nvfp4-pack-quantized'
  t = st.load_file(str(tmp_path / files.WEIGHTS))
  assert t['fc.weight_scale'].dtype == torch.float8_e4m3fn
  f32, bf16 = _nv_reference(t, qc)
  want = _weights(served)
  np.testing.assert_array_equal(f32, want)
  np.testing.assert_array_equal(bf16, _as_bf16(want))
  back = ck.load(
    nnx.eval_shape(_linear), str(tmp_path), EYE, names=lambda p: 'fc.weight'
  )
  x = jax.random.normal(jax.random.key(0), (3, D_IN))
  np.testing.assert_array_equal(back(x), served(x))
