"""Bad input to the core API: one clear error naming the culprit (issue 9).

A `key` that is not a PRNG key names `key` and what is allowed (also where
the config does not use it); an einsum output letter missing from the
inputs is named; a frozen QTensor whose scale has the wrong shape names the
operand and both shapes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import aqtr

MK_KN = (((1,), (0,)), ((), ()))
_X, _W = jnp.ones((4, 8)), jnp.ones((8, 3))


@pytest.mark.parametrize('key', ['abc', 3, [0, 1], jnp.zeros(3)], ids=repr)
@pytest.mark.parametrize(
  'cfg',
  [None, aqtr.presets.int8(), aqtr.presets.fully_quantized(8, 8, True)],
  ids=['none', 'int8', 'stochastic'],
)
def test_a_bad_key_names_key_and_what_is_allowed(cfg, key):
  with pytest.raises(TypeError, match=r'key must be None, a typed PRNG key'):
    aqtr.dot_general(_X, _W, MK_KN, cfg, key=key)
  with pytest.raises(TypeError, match=r'jax\.random\.PRNGKey'):
    aqtr.einsum('mk,kn->mn', _X, _W, config=cfg, key=key)


def test_good_keys_still_work():
  cfg = aqtr.presets.fully_quantized(8, 8, True)
  for key in (jax.random.key(0), jax.random.PRNGKey(0)):
    assert aqtr.dot_general(_X, _W, MK_KN, cfg, key=key).shape == (4, 3)
  # A key the config does not need is accepted (and unused).
  a = aqtr.dot_general(_X, _W, MK_KN, aqtr.presets.int8(), key=key)
  assert (a == aqtr.dot_general(_X, _W, MK_KN, aqtr.presets.int8())).all()


@pytest.mark.parametrize('cfg', [None, aqtr.presets.int8()], ids=str)
def test_einsum_names_an_output_letter_missing_from_the_inputs(cfg):
  match = "'z'" if cfg is None else "'z' is not an input letter"
  with pytest.raises(ValueError, match=match):
    aqtr.einsum('mk,kn->mz', _X, _W, config=cfg)


def test_einsum_names_letters_and_repeats():
  cfg = aqtr.presets.int8()
  with pytest.raises(ValueError, match="'y', 'z' are not input letters"):
    aqtr.einsum('mk,kn->yz', _X, _W, config=cfg)
  with pytest.raises(ValueError, match="'mm' repeats a letter"):
    aqtr.einsum('mk,kn->mm', _X, _W, config=cfg)


@pytest.mark.parametrize('operand', ['lhs', 'rhs'])
def test_frozen_scale_of_the_wrong_shape_names_operand_and_shapes(operand):
  cfg = aqtr.presets.int8()
  x = _X if operand == 'lhs' else _W
  qt = jax.jit(lambda x: aqtr.quantize_operand(x, MK_KN, cfg, operand=operand))(
    x
  )
  want = tuple(qt.scale.shape)
  for bad in [(1, 1, 5, 1), (1, 1, 1, 1)]:
    args = [_X, _W]
    args[operand == 'rhs'] = dataclasses.replace(qt, scale=jnp.ones(bad))
    with pytest.raises(ValueError) as e:
      aqtr.dot_general(*args, MK_KN, cfg)
    msg = str(e.value)
    assert f'given as {operand}' in msg
    assert f'scale shape {bad} != expected {want}' in msg
