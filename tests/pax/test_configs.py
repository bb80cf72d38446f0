"""configs/pax: the float experiment quantized by rules in a separate file."""

import importlib.util
import pathlib

import fiddle as fdl
import numpy as np

import aqtr

ROOT = pathlib.Path(__file__).resolve().parents[2] / 'configs' / 'pax'


def _load(name):
  spec = importlib.util.spec_from_file_location(name, ROOT / f'{name}.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


INT8 = _load('pax_lm_int8')


def test_rules_quantize_without_editing_the_experiment():
  float_exp = INT8.pax_lm.experiment()
  exp = INT8.experiment()
  assert fdl.build(float_exp.model).layers[0].ffn.wi.einsum.config is None
  model = fdl.build(exp).model
  assert model.layers[0].ffn.wi.einsum.config == aqtr.presets.int8()
  assert model.layers[1].attention.qk_einsum.config is None
  assert model.embedding.einsum.config == aqtr.presets.int8_weight_only()


def test_mixed_precision_json_builds():
  model = fdl.build(INT8.mixed_precision_experiment()).model
  q = model.layers[0].attention.q_proj.einsum.config
  assert (q.fwd.lhs.numerics.bits, q.fwd.rhs.numerics.bits) == (8, 4)
  wo = model.layers[1].ffn.wo.einsum.config
  assert not wo.fwd.lhs.quantized and wo.fwd.rhs.numerics.bits == 8


def test_injected_lm_trains():
  exp = INT8.experiment()
  exp.steps = 30
  losses = np.array(INT8.pax_lm.train(exp))
  assert np.all(np.isfinite(losses))
  assert losses[-5:].mean() < losses[:5].mean() - 1.0, losses
