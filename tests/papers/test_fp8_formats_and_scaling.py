"""papers/fp8_formats_and_scaling at the reduced size: the claim holds."""

import pytest

from papers.fp8_formats_and_scaling import config, run


@pytest.fixture(scope='module')
def rows(tmp_path_factory):
  out = tmp_path_factory.mktemp('fp8')
  return {r['run']: r for r in run.run(config.small(), out, echo=False)}


def test_fp8_recipe_trains_like_float(rows):
  assert rows['fp8']['teacher'] / rows['float']['teacher'] < 1.25


def test_unscaled_e4m3_gradients_are_several_times_worse(rows):
  assert rows['e4m3_unscaled']['teacher'] / rows['fp8']['teacher'] > 3.0


def test_delayed_scaling_trains_like_dynamic_per_tensor(rows):
  ratio = rows['fp8_delayed']['teacher'] / rows['fp8_per_tensor']['teacher']
  assert ratio < 1.1, ratio


def test_unscaled_config_is_a_plain_cast():
  cfg = config.gradients('float8_e4m3fn', scaled=False)
  assert cfg.dlhs.lhs.calibration.bound == 448.0
  assert cfg.fwd.lhs.calibration.clip_scale == 1.0  # forward still scaled


@pytest.mark.slow
def test_full_size_matches_readme(tmp_path):
  rows = {r['run']: r for r in run.run(config.full(), tmp_path, echo=False)}
  ref = rows['float']
  assert rows['fp8']['teacher'] / ref['teacher'] < 1.25
  assert rows['e4m3_grads']['teacher'] / ref['teacher'] < 1.25
  assert abs(rows['fp8']['digits'] - ref['digits']) <= 0.5
  unscaled = rows['e4m3_unscaled']['teacher'], rows['e5m2_unscaled']['teacher']
  assert unscaled[0] > unscaled[1] > 3.0 * rows['fp8']['teacher']
  assert rows['fp8']['digits'] - rows['e4m3_unscaled']['digits'] >= 50.0
  delayed, dynamic = rows['fp8_delayed'], rows['fp8_per_tensor']
  assert delayed['teacher'] / dynamic['teacher'] < 1.1
  assert abs(delayed['digits'] - dynamic['digits']) <= 0.5
