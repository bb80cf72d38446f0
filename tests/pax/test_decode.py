"""aqtr.pax.decode: prefill + steps through the cache == the full forward."""

import functools

import fiddle as fdl
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr.pax import decode, kv_cache, templates
from aqtr.pax.kv_cache import KVCacheConfig

V, L = 32, 16


@functools.cache
def _model(quantized: bool = False):
  cfg = templates.transformer_lm(
    vocab_size=V,
    d_model=16,
    num_layers=2,
    num_heads=2,
    hidden_dim=32,
    max_len=L,
    tied=False,
    norm_kind='layer',
  )
  if quantized:
    rule = aqtr.pax.Rule(aqtr.presets.int8(), tag=aqtr.pax.tags.WeightOp)
    cfg, _ = aqtr.pax.inject(cfg, [rule])
  lm = fdl.build(cfg)
  params = lm.init(jax.random.key(0), jnp.zeros((1, L), jnp.int32))
  return lm, params


@functools.cache
def _full(quantized: bool = False):
  """Jitted full-sequence logits of sequences right-padded to L (causal:
  the padding does not change the logits of the real positions)."""
  lm, params = _model(quantized)
  apply = jax.jit(lm.apply)

  def logits(seqs):
    ids = np.zeros((len(seqs), L), np.int32)
    for i, s in enumerate(seqs):
      ids[i, : len(s)] = s
    return apply(params, jnp.asarray(ids))

  return logits


@functools.cache
def _decoder(kv=KVCacheConfig(), quantized=False):  # noqa: B008
  return decode.Decoder(_model(quantized)[0], kv=kv)


SEQS = [
  np.random.default_rng(0).integers(0, V, n).tolist() for n in (12, 7, 10)
]
PROMPTS = (5, 2, 4)


@pytest.mark.parametrize('quantized', [False, True])
def test_float_cache_reproduces_full_forward_logits(quantized):
  params = _model(quantized)[1]
  dec = _decoder(quantized=quantized)
  full = _full(quantized)(SEQS)
  ids, start = dec.pad([s[:n] for s, n in zip(SEQS, PROMPTS, strict=True)])
  logits, cache = dec.prefill(params, ids, start)
  width = ids.shape[1]
  for i, n in enumerate(PROMPTS):
    np.testing.assert_allclose(
      logits[i, width - n :], full[i][:n], rtol=1e-5, atol=1e-5
    )
  for j in range(5):  # Teacher-forced steps, each reading the cache.
    tokens = [s[n + j] for s, n in zip(SEQS, PROMPTS, strict=True)]
    step, cache = dec.step(params, tokens, cache)
    for i, n in enumerate(PROMPTS):
      np.testing.assert_allclose(step[i], full[i][n + j], rtol=1e-5, atol=1e-5)
  assert int(cache.index) == width + 5


def test_greedy_generation_equals_greedy_full_forward():
  params = _model()[1]
  prompts = [SEQS[0][:4], SEQS[1][:2]]
  out = _decoder().generate(params, prompts, max_new=6)
  seqs = [list(p) for p in prompts]
  for _ in range(6):
    logits = _full()(seqs)
    for i, s in enumerate(seqs):
      s.append(int(jnp.argmax(logits[i, len(s) - 1])))
  assert out.tokens == [s[len(p) :] for s, p in zip(seqs, prompts, strict=True)]
  assert out.stopped is None and out.kv_bytes > 0
  assert out.decode_s > 0 and 0 <= out.decode_cpu_s < float('inf')


@pytest.mark.parametrize(
  'kv',
  [
    KVCacheConfig(numerics='int8'),
    KVCacheConfig(numerics='int8', read='int8_dots'),
    KVCacheConfig(numerics='int4', scales='block', block_size=4),
    KVCacheConfig(numerics='fp8'),
    KVCacheConfig(
      numerics='int8', scales='block', block_size=4, read='int8_dots'
    ),
    KVCacheConfig(numerics='int8', calibration='static', bound=4.0),
  ],
  ids=['int8', 'int8_dots', 'int4_block', 'fp8', 'int8_block_dots', 'static'],
)
def test_quantized_cache_logits_stay_close(kv):
  params = _model()[1]
  seqs = [SEQS[0] + SEQS[1][:4], SEQS[2] + SEQS[1][:6]]
  want = _full()(seqs)
  got = _decoder(kv).logits(params, jnp.asarray(seqs))
  tol = {'int8': 0.1, 'fp8': 0.25, 'int4': 0.5}[kv.numerics]
  tol *= 2 if kv.calibration == 'static' else 1  # A coarser fixed step.
  assert float(jnp.abs(got - want).max()) < tol


def test_full_cache_stops_with_a_message():
  out = _decoder().generate(_model()[1], [SEQS[0][:10]], max_new=20)
  assert len(out.tokens[0]) == L - 10 + 1
  assert 'cache is full (16 slots) after 7 new token(s)' in out.stopped


def test_sampling_is_seeded_and_top_k_1_is_greedy():
  params = _model()[1]
  dec = _decoder()
  prompts = [SEQS[0][:3]]

  def run(**kw):
    return dec.generate(params, prompts, 8, decode.Sampling(**kw)).tokens

  hot = {'temperature': 5.0}
  assert run(seed=3, **hot) == run(seed=3, **hot)
  assert run(seed=3, **hot) != run(seed=4, **hot)
  assert run(temperature=1.0, top_k=1) == run()


@pytest.mark.parametrize(
  'call, match',
  [
    (lambda d, p: d.generate(p, [[1]], 0), 'max_new must be an int >= 1'),
    (lambda d, p: d.generate(p, [], 2), 'give at least one prompt'),
    (lambda d, p: d.generate(p, [[1], []], 2), 'prompt 1 is empty'),
    (
      lambda d, p: d.generate(p, [[1] * 17], 2),
      'prompt 0 has 17 tokens; the cache holds 16',
    ),
    (
      lambda d, p: d.generate(p, [[1], [2] * 20], 2),
      'prompt 1 has 20 tokens; the cache holds 16',
    ),
    (lambda d, p: d.generate(p, [[V]], 2), 'outside the vocabulary'),
    (
      lambda d, p: d.generate(p, [[1]], 2, decode.Sampling(top_k=V + 1)),
      'top_k=33 exceeds the vocabulary size 32',
    ),
    (lambda d, p: decode.Sampling(temperature=-1), 'temperature must be'),
    (lambda d, p: decode.Sampling(top_k=-1), 'top_k must be an int >= 0'),
    (
      lambda d, p: decode.Decoder(_model()[0], length=L + 1),
      "length=17 exceeds the model's max_len=16",
    ),
    (
      lambda d, p: decode.Decoder(_model()[0], kv='int8'),
      'kv must be a KVCacheConfig',
    ),
  ],
)
def test_bad_input_is_one_clear_line(call, match):
  with pytest.raises(ValueError, match=match) as e:
    call(_decoder(), _model()[1])
  assert '\n' not in str(e.value)


def test_cache_bytes_match_the_config():
  dec = _decoder(KVCacheConfig(numerics='int4'))
  cache = dec.init(3, np.zeros(3, np.int32))
  # 2 layers x (k, v) x 3 seqs x 16 slots x 2 heads x (4 code bytes + 4).
  assert kv_cache.nbytes(cache.layers) == 2 * 2 * 3 * 16 * 2 * 8


def _cache_copies_in_loop(dec) -> int:
  """Copies of a whole cache-shaped array (float32 values or int8 codes)
  in the compiled decode loop (the un-donated input cache is copied once
  outside the loop)."""
  lm, params = _model()
  dec.generate(params, [[1, 2, 3]], 2)
  ((_, loop),) = dec._compiled.values()
  att = lm.layers[0].attention
  h = att.q_proj.features // att.num_heads
  dtype = 's8' if dec.kv.quantized else 'f32'
  shape = f'{dtype}[1,{att.num_heads},{dec.length},{h}]'
  copies = [
    line
    for line in loop.as_text().splitlines()
    if f'= {shape}' in line and ' copy(' in line
  ]
  return len(copies) - 2 * len(lm.layers)  # The input's own copies.


@pytest.mark.parametrize('numerics', ['none', 'int8'])
def test_a_cache_is_not_copied_in_the_decode_loop(numerics):
  # XLA fused the cache update into each reader and copied every cache
  # array per step (an int8 cache's codes four times: the int8 dots read
  # them with batch and heads merged); behind a fusion boundary it is
  # written in place.
  kv = KVCacheConfig(numerics=numerics)
  assert _cache_copies_in_loop(decode.Decoder(_model()[0], kv=kv)) == 0


@pytest.mark.slow
@pytest.mark.parametrize('numerics', ['none', 'int8'])
def test_the_cache_copy_check_sees_copies_without_the_boundary(
  monkeypatch, numerics
):
  monkeypatch.setattr(kv_cache, 'fusion_boundary', lambda tree: tree)
  kv = KVCacheConfig(numerics=numerics)
  assert _cache_copies_in_loop(decode.Decoder(_model()[0], kv=kv)) > 0
