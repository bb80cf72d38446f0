"""Transforms and the 4-bit recipes on bad arguments: one clear line."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from aqtr import presets
from aqtr.transforms.hadamard import Hadamard

X = jnp.arange(8.0).reshape(2, 4)


@pytest.mark.parametrize('axis', [5, -3, 2])
def test_hadamard_axis_out_of_range_is_one_line(axis):
  with pytest.raises(ValueError, match=f'axis={axis} is out of range'):
    Hadamard(block_size=4).apply(X, axis=axis)
  with pytest.raises(ValueError, match=f'axis={axis} is out of range'):
    Hadamard(block_size=4).inverse(X, axis=axis)


def test_hadamard_axis_must_be_an_int():
  with pytest.raises(TypeError, match='axis must be an int'):
    Hadamard(block_size=4).apply(X, axis=1.0)
  y = Hadamard(block_size=4).apply(X, axis=-1)
  assert jnp.array_equal(y, Hadamard(block_size=4).apply(X, axis=1))


@pytest.mark.parametrize(
  'make, flag',
  [
    (lambda: presets.nvfp4_training(rht='no'), 'rht'),
    (lambda: presets.nvfp4_training(stochastic_rounding=0), 'stochastic_r'),
    (lambda: presets.nvfp4_training(weight_blocks_2d=None), 'weight_blocks'),
    (lambda: presets.mxfp4_training(hadamard='no'), 'hadamard'),
    (lambda: presets.mxfp4_training(forward_hadamard=1), 'forward_hadamard'),
    (lambda: presets.fully_quantized(stochastic_rounding='yes'), 'stochas'),
  ],
)
def test_recipe_flags_take_a_bool_only(make, flag):
  with pytest.raises(TypeError, match=f'{flag}.* must be True or False'):
    make()
