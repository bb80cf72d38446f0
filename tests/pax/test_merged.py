"""aqtr.pax.merged: served Q, K and V as one dot, the same bits as three."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
import aqtr.flax.linen as aqtr_linen
from aqtr.freezers import Mode
from aqtr.pax import decode, merged
from aqtr.pax.kv_cache import KVCacheConfig
from aqtr.train import models

L = 16


@functools.cache
def _models(preset: str = 'int8'):
  """(train lm, params, served lm, served variables) of a tiny LM."""
  template = models.lm(vocab_size=32, seq_len=L, d_model=16, num_heads=2)
  x = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, L)))
  injected, _ = models.inject(template, getattr(aqtr.presets, preset)())
  train = models.build(injected)
  params = train.init(jax.random.key(0), x)
  conv = models.build(models.serving_template(injected, Mode.CONVERT))
  served_vars = aqtr_linen.convert(conv, params, x)
  served = models.build(models.serving_template(injected, Mode.SERVE))
  return train, params, served, served_vars, x


def _unmerged(monkeypatch):
  monkeypatch.setattr(merged, 'mergeable', lambda *a, **k: False)


def _dot_widths(lm, variables, x) -> set[int]:
  """Output widths of the int8 dots in the lowered forward."""
  text = jax.jit(lm.apply).lower(variables, x).as_text()
  dots = re.findall(r'dot_general.*-> tensor<(?:\d+x)*(\d+)xi32>', text)
  return {int(w) for w in dots}


def test_served_qkv_is_one_dot_with_the_same_bits(monkeypatch):
  train, params, served, variables, x = _models()
  widths = _dot_widths(served, variables, x)
  assert {48, 16} <= widths  # q|k|v, o
  got = jax.jit(served.apply)(variables, x)
  np.testing.assert_array_equal(got, jax.jit(train.apply)(params, x))
  _unmerged(monkeypatch)
  assert 48 not in _dot_widths(served, variables, x)
  np.testing.assert_array_equal(got, jax.jit(served.apply)(variables, x))


def test_decoding_serves_the_training_model_bit_for_bit(monkeypatch):
  train, params, served, variables, x = _models()
  kv = KVCacheConfig(numerics='int8')
  prompts = [x[0, :5].tolist(), x[1, :3].tolist()]
  dec = decode.Decoder(served, kv=kv)
  ref = decode.Decoder(train, kv=kv)
  ids, start = dec.pad(prompts)
  logits, cache = dec.prefill(variables, ids, start)
  want, ref_cache = ref.prefill(params, ids, start)
  np.testing.assert_array_equal(logits, want)
  step, _ = dec.step(variables, [1, 2], cache)
  np.testing.assert_array_equal(step, ref.step(params, [1, 2], ref_cache)[0])
  _unmerged(monkeypatch)
  plain = decode.Decoder(served, kv=kv)
  np.testing.assert_array_equal(plain.prefill(variables, ids, start)[0], want)


@pytest.mark.parametrize('preset', ['fp8', 'int4_weight_only'])
def test_other_weight_formats_serve_as_they_train(preset):
  train, params, served, variables, x = _models(preset)
  got = jax.jit(served.apply)(variables, x)
  np.testing.assert_array_equal(got, jax.jit(train.apply)(params, x))


def test_only_served_frozen_projections_merge():
  train, params, served, variables, x = _models()
  att = served.layers[0].attention
  frozen = variables['aqtr']['layers_0']['attention']
  entries = [
    next(iter(frozen[n]['einsum'].values())) for n in ('q_proj', 'k_proj')
  ]
  linears = [att.q_proj, att.k_proj]
  assert merged.mergeable(linears, entries)
  assert not merged.mergeable(linears[:1], entries[:1])  # One alone.
  assert not merged.mergeable(linears, entries[:1])
  train_att = train.layers[0].attention  # TRAIN mode: quantized on the fly.
  assert not merged.mergeable([train_att.q_proj] * 2, entries)
  wider = [att.q_proj, att.q_proj.clone(features=32)]
  assert not merged.mergeable(wider, entries)  # Features mismatch.
  extra = [{**entries[0], 'lhs': {}}, entries[1]]
  assert not merged.mergeable(linears, extra)  # An activation frozen.
