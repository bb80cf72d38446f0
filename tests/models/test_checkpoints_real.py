"""aqtr.checkpoints on real third-party models (the `models` extra).

export -> load serves bit for bit what was exported, for every real LM of
`zoo.py` whose weights the layouts hold (2-D kernels of Dense layers):
Hugging Face Llama, Mistral, OPT and BLOOM. The rules
quantize every op (no `weight=True`, as a user writes them), so the
attention's activation x activation einsums are quantized too: the
checkpoint holds the weights, and `load(..., rules=)` the rest. One
conversion per (model, case), shared; one model in the default suite.
Refused in one line: DeepMind's Gemma and Griffin keep their weights in
einsum kernels of 3 or more axes and ViT has a convolution kernel, which
no layout stores; GPT-2's Conv1D reads `kernel.transpose()`, a derived
weight with no frozen holder of its own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo

import aqtr
import aqtr.flax as af
from aqtr import checkpoints as ck
from aqtr.flax import Rule

CASES = {
  'int4_g16_asym': lambda: aqtr.presets.int4_asym_weight_only(group=16),
  'int8_channel': aqtr.presets.int8_weight_only,
  'w8a8': aqtr.presets.int8,  # The weight ops' inputs are quantized too.
}
HF = ('hf_llama_gqa', 'hf_mistral', 'hf_opt', 'hf_bloom')
DEFAULT = ('hf_opt', 'int4_g16_asym')  # The one in the default suite.


def _zoo(name):
  return next(z for z in zoo.MODELS if z.name == name)


@functools.cache
def _served(name, case):
  """(model, sample, served module, served variables, rules): one
  conversion per (model, case)."""
  z = _zoo(name)
  model, x = z.build(), z.sample()
  rules = [Rule(CASES[case]())]
  q = af.quantize(model, rules)
  v = jax.jit(q.init)(jax.random.key(0), x)
  sm, sv = af.convert(q, x, variables=v, check=False)
  return model, x, sm, sv, rules


def _params():
  out = []
  for name in HF:
    for case in CASES:
      marks = [] if _zoo(name).available() else [pytest.mark.skip('models')]
      if (name, case) != DEFAULT:
        marks.append(pytest.mark.slow)
      out.append(pytest.param(name, case, marks=marks, id=f'{name}-{case}'))
  return out


@pytest.mark.parametrize('name,case', _params())
def test_export_load_serves_bit_for_bit(name, case, tmp_path):
  model, x, sm, sv, rules = _served(name, case)
  with pytest.warns(UserWarning, match='give load the same rules'):
    info = ck.export(sm, str(tmp_path), variables=sv, format='gptq')
  assert info['quantized'] >= 8
  abstract = jax.eval_shape(model.init, jax.random.key(0), x)
  m2, sv2 = ck.load(model, str(tmp_path), x, variables=abstract, rules=rules)
  want = sm.apply(sv, x)
  np.testing.assert_array_equal(m2.apply(sv2, x), want)
  # The stored weights are those of the served model, code for code.
  a, _ = ck.tree.read_frozen(sm, sv)
  b, _ = ck.tree.read_frozen(m2, sv2)
  assert sorted(a) == sorted(b)
  for path in a:
    np.testing.assert_array_equal(a[path].dequant(), b[path].dequant())
  if case == 'int8_channel':  # Weight-only int8 leaves attention float.
    return
  # Without the rules only the stored weights are quantized: the
  # attention (and the w8a8 inputs) run float, and the logits differ.
  m3, sv3 = ck.load(model, str(tmp_path), x, variables=abstract)
  assert float(jnp.abs(m3.apply(sv3, x) - want).max()) > 0


@pytest.mark.slow
@pytest.mark.parametrize(
  'name,why',
  [
    ('gemma2', '2-D'),
    ('griffin', '2-D'),
    ('hf_vit', '2-D'),
    ('hf_gpt2', 'read only through a derived weight'),
  ],
)
def test_kernels_no_layout_holds_are_refused_in_one_line(name, why, tmp_path):
  z = _zoo(name)
  if not z.available():
    pytest.skip(z.package)
  model, x = z.build(), z.sample()
  q = af.quantize(model, [Rule(aqtr.presets.int8_weight_only(), weight=True)])
  v = jax.jit(q.init)(jax.random.key(0), x)
  sm, sv = af.convert(q, x, variables=v, check=False)
  with pytest.raises(ck.CheckpointError, match=why) as e:
    ck.export(sm, str(tmp_path), variables=sv)
  assert '\n' not in str(e.value)


@pytest.mark.slow
def test_act_order_gptq_checkpoint_serves_its_weights(tmp_path):
  """Every weight of HF OPT given AutoGPTQ's act-order g_idx (desc_act):
  served as the reference dequantizes it, written back byte for byte."""
  import dataclasses

  import flax

  from aqtr.checkpoints import files

  z = _zoo('hf_opt')
  if not z.available():
    pytest.skip(z.package)
  model, x, sm, sv, _ = _served('hf_opt', 'int4_g16_asym')
  plain, act = tmp_path / 'plain', tmp_path / 'act'
  with pytest.warns(UserWarning, match='give load the same rules'):
    ck.export(sm, str(plain), variables=sv, format='gptq')
  weights, rest, _ = ck.read(str(plain))
  rng = np.random.default_rng(0)
  weights = {
    m: dataclasses.replace(
      w, g_idx=w.rows[np.argsort(rng.permutation(w.d_in))].astype(np.int32)
    )
    for m, w in weights.items()
  }
  tensors, qc = ck.Gptq().encode(weights)
  tensors.update(rest)
  act.mkdir()
  files.write(str(act / files.WEIGHTS), tensors)
  files.write_config(str(act), {'quantization_config': qc})
  abstract = jax.eval_shape(model.init, jax.random.key(0), x)
  m2, sv2 = ck.load(model, str(act), x, variables=abstract)
  frozen, floats = ck.tree.read_frozen(m2, sv2)
  assert all(w.g_idx is not None for w in frozen.values())
  dense = {**floats, **{p: w.dequant() for p, w in frozen.items()}}
  want = model.apply({'params': flax.traverse_util.unflatten_dict(dense)}, x)
  np.testing.assert_allclose(m2.apply(sv2, x), want, rtol=1e-4, atol=1e-4)
  again = tmp_path / 'again'
  ck.export(m2, str(again), variables=sv2, format='gptq')
  back = files.read(str(again / files.WEIGHTS))
  assert sorted(back) == sorted(tensors)
  for k in tensors:
    np.testing.assert_array_equal(back[k], tensors[k])
