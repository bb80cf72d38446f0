"""Pins aqtr's public names: adding or removing one is a deliberate change."""

from __future__ import annotations

import inspect
import subprocess
import sys

import aqtr

PUBLIC = {
  'DotGeneralConfig',
  'DotGeneralRaw',
  'Mode',
  'NearestEven',
  'QTensor',
  'RAGGED',
  'Registry',
  'Rounding',
  'Stochastic',
  'TensorConfig',
  'UnknownNameError',
  'calibrations',
  'conv_general_dilated',
  'dot_general',
  'einsum',
  'fake_quant',
  'fiddle',
  'fiddlers',
  'freezers',
  'numerics',
  'presets',
  'quantize',
  'quantize_operand',
  'ragged_dot',
  'selectors',
  'sparsity',
  'state',
  'tags',
  'tilings',
  'transforms',
  'validation',
}

PRESETS = {
  'aqt_v4',
  'deepseek_v3_fp8',
  'maxtext_deepseek_fp8',
  'float',
  'fp8',
  'fp8_nanoo',
  'fp8_delayed',
  'fp8_full',
  'fully_quantized',
  'int4_asym_weight_only',
  'int4_lsq',
  'int4_weight_only',
  'int8',
  'int8_fwd',
  'int8_sparse_2_4',
  'int8_weight_only',
  'mxfp4_training',
  'mxfp4_weight_only',
  'mxfp8',
  'nvfp4',
  'nvfp4_training',
  'nvfp4_weight_only',
  'switchback',
  'w4a8',
}


def test_all_is_pinned():
  assert set(aqtr.__all__) == PUBLIC
  assert len(aqtr.__all__) == len(PUBLIC)  # no duplicates
  assert list(aqtr.__all__) == sorted(aqtr.__all__)


def test_every_public_name_resolves():
  for name in aqtr.__all__:
    assert getattr(aqtr, name) is not None, name
  assert isinstance(aqtr.__version__, str)


def test_presets_are_pinned():
  assert set(aqtr.presets.__all__) == PRESETS
  for name in PRESETS:
    assert callable(getattr(aqtr.presets, name))


def test_registry_modules_share_one_interface():
  families = (
    aqtr.calibrations,
    aqtr.numerics,
    aqtr.tilings,
    aqtr.sparsity,
    aqtr.freezers,
    aqtr.transforms,
  )
  for family in families:
    for name in ('register', 'get', 'names', 'registry'):
      assert name in family.__all__, (family.__name__, name)
    assert isinstance(family.registry, aqtr.Registry)


def test_public_signatures():
  """The keyword names other code relies on (issue 2)."""
  dg = inspect.signature(aqtr.dot_general).parameters
  assert list(dg)[:4] == ['lhs', 'rhs', 'dimension_numbers', 'config']
  for kw in ('key', 'precision', 'preferred_element_type'):
    assert dg[kw].kind is inspect.Parameter.KEYWORD_ONLY
  es = inspect.signature(aqtr.einsum).parameters
  assert list(es)[:3] == ['subscripts', 'lhs', 'rhs']
  for kw in ('config', 'key'):
    assert es[kw].kind is inspect.Parameter.KEYWORD_ONLY
  fq = inspect.signature(aqtr.presets.fully_quantized).parameters
  assert list(fq) == ['fwd_bits', 'bwd_bits', 'stochastic_rounding']
  for name in ('DotGeneralConfig', 'DotGeneralRaw', 'TensorConfig'):
    params = inspect.signature(getattr(aqtr, name)).parameters.values()
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params)
  dgc = inspect.signature(aqtr.DotGeneralConfig).parameters
  assert list(dgc) == ['fwd', 'dlhs', 'drhs']


def test_import_does_not_pull_optional_dependencies():
  code = (
    'import sys, aqtr; '
    "bad = [m for m in ('flax', 'gin', 'optax', 'orbax', 'aqtr.qt', "
    "'aqtr.lora', "
    "'notebook', "
    "'IPython') if m in sys.modules]; "
    'print(bad); sys.exit(1 if bad else 0)'
  )
  result = subprocess.run(
    [sys.executable, '-c', code], capture_output=True, text=True, check=False
  )
  assert result.returncode == 0, result.stdout + result.stderr


LORA = {
  'Adapter',
  'Bytes',
  'LoraConfig',
  'LoraEinsum',
  'Site',
  'attach',
  'check',
  'check_nnx',
  'combine',
  'dropout',
  'merge',
  'nf4',
  'nnx_optimizer',
  'optimizer',
  'partition',
  'sites',
  'sizes',
  'trainable',
}


def test_lora_api_is_pinned():
  import aqtr.lora

  assert set(aqtr.lora.__all__) == LORA
  assert list(aqtr.lora.__all__) == sorted(aqtr.lora.__all__)
  for name in LORA:
    assert getattr(aqtr.lora, name) is not None, name
