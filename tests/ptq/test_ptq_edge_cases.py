"""aqtr.ptq on degenerate calibration data and options: one clear line,
never a served model of zeros or a report of a perfect 0.0 error."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import aqtr
import aqtr.ptq as ptq
from aqtr.rules import Rule

from .helpers import correlated

INT4 = [Rule(aqtr.presets.int4_weight_only())]


def _model():
  return nnx.Linear(32, 8, rngs=nnx.Rngs(0))


def _xs(n=2):
  return [correlated(jax.random.key(i), 64, 32) for i in range(n)]


def test_gptq_on_all_zero_batches_is_one_line():
  with pytest.raises(ValueError, match='every calibration input .* is zero'):
    ptq.quantize(_model(), INT4, [jnp.zeros((64, 32))], method='gptq')


def test_gptq_on_a_batch_of_no_tokens_is_one_line():
  with pytest.raises(ValueError, match=r'is zero \(0 tokens\)'):
    ptq.quantize(_model(), INT4, [jnp.zeros((0, 32))], method='gptq')


def test_rtn_error_of_all_zero_inputs_is_nan_not_zero():
  _, rep = ptq.quantize(_model(), INT4, [jnp.zeros((64, 32))], method='rtn')
  assert math.isnan(rep.layers[0].error)
  assert ptq.relative_error(jnp.ones((2, 1)), jnp.ones((2, 1)), jnp.eye(2)) == 1


@pytest.mark.parametrize('method', ['rtn', 'gptq'])
@pytest.mark.parametrize('bad', [jnp.nan, jnp.inf])
def test_non_finite_calibration_batch_is_named(method, bad):
  xs = _xs()
  xs[1] = xs[1].at[3, 4].set(bad)
  with pytest.raises(ValueError, match='calibration batch 1 holds 1 non-fin'):
    ptq.quantize(_model(), INT4, xs, method=method)


def test_non_finite_weight_row_is_named():
  m = _model()
  m.kernel[...] = m.kernel[...].at[5].set(jnp.nan)
  with pytest.raises(
    ValueError, match=r'dot_general0: the float weight holds 8 non-finite'
  ):
    ptq.quantize(m, INT4, _xs(), method='gptq')


def test_gptq_static_groups_takes_a_bool_only():
  with pytest.raises(TypeError, match='Gptq.static_groups must be True or'):
    ptq.Gptq(static_groups='no')


def test_unknown_method_option_lists_the_options():
  with pytest.raises(TypeError, match=r"no option\(s\) \['foo'\]; its options"):
    ptq.quantize(_model(), INT4, _xs(), method='gptq', foo=1)


@pytest.mark.parametrize('method', ['rtn', 'gptq'])
def test_serve_check_never_blocks_ptq(monkeypatch, method):
  """PTQ writes its own serving values: convert's serve == train check
  (which raises on any difference on CPU) is not run."""
  from aqtr.flax import serving  # noqa: PLC0415

  def refuse(*args):
    raise AssertionError('ptq ran the serve == train check')

  monkeypatch.setattr(serving, 'check_served', refuse)
  served, rep = ptq.quantize(_model(), INT4, _xs(), method=method)
  assert served(_xs(1)[0]).shape == (64, 8)
  assert all(math.isfinite(r.error) for r in rep.layers)
