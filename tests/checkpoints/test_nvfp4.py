"""aqtr.checkpoints: NVFP4 two-level scales without the reference
packages (those checks: test_reference.py)."""

import jax
import numpy as np
import pytest
from flax import nnx

import aqtr
from aqtr import checkpoints as ck
from aqtr.checkpoints.stored import Stored
from aqtr.flax import convert, quantize
from aqtr.rules import Rule


def _linear():
  return nnx.Linear(64, 32, use_bias=False, rngs=nnx.Rngs(0))


def _nv(scale):
  n = scale.shape[0] * 16
  q = np.random.default_rng(0).integers(0, 16, (n, scale.shape[1]))
  return Stored(q=q.astype(np.uint8), scale=scale, group=16, kind='nvfp4')


def test_nvfp4_two_level_scales_or_one_line_refusal():
  # aqtr's two-level scales: e4m3 d times an 18-bit f32 tensor scale s_t.
  d = np.array([[448, 3.5, 0.001953125], [96, 13, 240]], np.float32)
  s_t = np.float32(1.2345678e-3)
  s_t = np.ldexp(np.round(np.ldexp(s_t, 27)), -27).astype(np.float32)
  t, qc = ck.CompressedTensors().encode({'fc': _nv(d * s_t)})
  g = t['fc.weight_global_scale']
  np.testing.assert_array_equal(t['fc.weight_scale'].astype(np.float32), d.T)
  np.testing.assert_array_equal(
    t['fc.weight_scale'].astype(np.float32) / g, (d * s_t).T
  )
  (back,) = ck.CompressedTensors().decode(t, qc)[0].values()
  np.testing.assert_array_equal(back.dequant(), _nv(d * s_t).dequant())
  # Scales that no e4m3 x global scale pair gives: refused, one line.
  bad = _nv(np.array([[0.1, 0.1 + 1e-7]], np.float32))
  with pytest.raises(ck.CheckpointError, match=r'^fc\.weight_scale: aqtr') as e:
    ck.CompressedTensors().encode({'fc': bad})
  assert '\n' not in str(e.value)
  for fmt in ('gptq', 'awq'):
    with pytest.raises(ck.CheckpointError, match=rf'^fc: nvfp4 .* {fmt}'):
      ck.layout(fmt).encode({'fc': bad})


BAD_NV = {
  'group size': (
    lambda t, w: w.update(group_size=32),
    r'^fc\.weight_packed: .* group_size=32 .* NVFP4 is',
  ),
  'scale shape': (
    lambda t, w: t.update({'fc.weight_scale': t['fc.weight_scale'][:, :1]}),
    r'^fc\.weight_scale: shape \(2, 1\), but .*group_size=16 gives \(2, 2\)',
  ),
  'global scale': (
    lambda t, w: t.pop('fc.weight_global_scale'),
    r'^fc\.weight_global_scale: missing tensor',
  ),
}


@pytest.mark.parametrize('case', sorted(BAD_NV))
def test_bad_nvfp4_checkpoint_one_line(case):
  t, qc = ck.CompressedTensors().encode(
    {'fc': _nv(np.ones((2, 2), np.float32))}
  )
  (group,) = qc['config_groups'].values()
  BAD_NV[case][0](t, group['weights'])
  with pytest.raises(ck.CheckpointError, match=BAD_NV[case][1]) as e:
    ck.CompressedTensors().decode(t, qc)
  assert '\n' not in str(e.value)


@pytest.mark.slow
def test_nvfp4_w4a4_round_trip_with_rules(tmp_path):
  # presets.nvfp4: NVFP4 weights and inputs; the checkpoint holds the
  # weights, load's rules the inputs (a top-level layer: no module path).
  rules = [Rule(aqtr.presets.nvfp4(), weight=True)]
  x = jax.random.normal(jax.random.key(0), (3, 64))
  served = convert(quantize(_linear(), rules), x)
  with pytest.warns(UserWarning, match='argument rules'):
    ck.export(served, str(tmp_path), names=lambda p: 'fc.weight')
  back = ck.load(
    nnx.eval_shape(_linear),
    str(tmp_path),
    x,
    names=lambda p: 'fc.weight',
    rules=rules,
  )
  np.testing.assert_array_equal(back(x), served(x))
