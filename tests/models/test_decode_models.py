"""Real LMs decoded through their own caches (`aqtr.flax.decode`), with
caches stored by rule and weights converted by `aqtr.flax.convert`; and
gemma's own Sampler with a quantized cache. Toy sizes, random weights;
each compiles the models: slow."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo

import aqtr.flax
from aqtr.flax.decode import Decoder, Sampling
from aqtr.rules import Rule

pytestmark = pytest.mark.slow
S = 2 * zoo.T  # cache slots: the models' positions
PROMPTS = [[5, 9, 2, 7, 11, 3], [4, 8]]


def _hf_model(name):
  transformers = pytest.importorskip('transformers')
  small = dict(vocab_size=zoo.VOCAB, num_hidden_layers=zoo.LAYERS)
  if name == 'gpt2':
    cfg = transformers.GPT2Config(
      vocab_size=zoo.VOCAB,
      n_embd=zoo.D,
      n_layer=zoo.LAYERS,
      n_head=zoo.HEADS,
      n_positions=S,
    )
    return transformers.FlaxGPT2LMHeadModel(cfg, seed=0)
  if name == 'mistral':
    cfg = transformers.MistralConfig(
      **zoo._hf_llama_kw(), num_key_value_heads=2, sliding_window=S
    )
    return transformers.FlaxMistralForCausalLM(cfg, seed=0)
  if name == 'opt':
    cfg = transformers.OPTConfig(
      **small,
      hidden_size=zoo.D,
      ffn_dim=2 * zoo.D,
      num_attention_heads=zoo.HEADS,
      max_position_embeddings=S,
      word_embed_proj_dim=zoo.D,
    )
    return transformers.FlaxOPTForCausalLM(cfg, seed=0)
  if name == 'bloom':  # (ALiBi: no positions, no length bound)
    cfg = transformers.BloomConfig(
      vocab_size=zoo.VOCAB, hidden_size=zoo.D, n_layer=zoo.LAYERS,
      n_head=zoo.HEADS,
    )  # fmt: skip
    return transformers.FlaxBloomForCausalLM(cfg, seed=0)
  cfg = transformers.LlamaConfig(**zoo._hf_llama_kw(), num_key_value_heads=2)
  return transformers.FlaxLlamaForCausalLM(cfg, seed=0)


def _alone_equals_batched(dec, variables):
  batched = dec.generate(variables, PROMPTS, 6).tokens
  alone = [dec.generate(variables, [p], 6).tokens[0] for p in PROMPTS]
  assert batched == alone


def _hf_inputs():
  ids = jnp.ones((1, 8), jnp.int32)
  pos = jnp.arange(8)[None]
  return ids, ids, pos


@pytest.mark.parametrize('name', ['gpt2', 'llama', 'mistral', 'opt', 'bloom'])
def test_hugging_face_lms_decode_through_their_own_caches(name):
  hf = _hf_model(name)
  dec = Decoder(hf, length=S)
  got = dec.generate(None, PROMPTS[:1], 8).tokens[0]
  if name == 'gpt2':  # (Llama's own generate fails on this tiny config.)
    own = hf.generate(jnp.asarray(PROMPTS[:1]), max_length=14).sequences
    assert got == np.asarray(own)[0, 6:].tolist()
  logits, _, _ = dec.prefill(None, PROMPTS[:1])
  full = hf(jnp.asarray(PROMPTS[:1])).logits
  np.testing.assert_allclose(logits, full, atol=1e-5)
  _alone_equals_batched(dec, None)
  f = dec.generate(None, PROMPTS, 8)
  h = zoo.D // zoo.HEADS  # codes + a float32 scale per token and head:
  int8, int4 = (h + 4) / (4 * h), (h / 2 + 4) / (4 * h)
  for kv, ratio in [('int8', int8), ('int4', int4), ('fp8', int8)]:
    q = Decoder(hf, length=S, kv=kv).generate(None, PROMPTS, 8)
    assert q.kv_bytes / f.kv_bytes <= ratio + 1e-3, (
      kv,
      q.kv_bytes / f.kv_bytes,
    )
    assert q.tokens[0][:2] == f.tokens[0][:2], kv  # (random weights)


@pytest.mark.parametrize('name', ['gpt2', 'llama'])
def test_converted_hugging_face_lms_decode_the_training_greedy(name):
  hf = _hf_model(name)
  path = '.*/h/.*' if name == 'gpt2' else '.*/layers/.*'
  q = aqtr.flax.quantize(hf.module, [Rule('int8', path=path)])
  variables = {'params': hf.params}
  served, svars = aqtr.flax.convert(q, *_hf_inputs(), variables=variables)
  want = Decoder(q, length=S).generate(variables, PROMPTS, 8).tokens
  got = Decoder(served, length=S).generate(svars, PROMPTS, 8)
  assert got.tokens == want
  int8 = Decoder(served, length=S, kv='int8')
  assert len(int8.generate(svars, PROMPTS, 8).tokens[1]) == 8


def _gemma(version):
  pytest.importorskip('gemma')
  lm = zoo._gemma(version)
  ids = jnp.asarray([PROMPTS[0]])
  params = jax.jit(lm.init)(jax.random.key(0), ids)['params']['inner']
  return lm, lm.inner, {'params': params}


@pytest.mark.parametrize('version', [2, 3])
def test_gemma_transformers_decode_through_their_own_caches(version):
  lm, transformer, variables = _gemma(version)
  dec = Decoder(transformer, length=S)
  logits, _, _ = dec.prefill(variables, PROMPTS[:1])
  full = lm.apply(
    {'params': {'inner': variables['params']}}, jnp.asarray(PROMPTS[:1])
  )
  np.testing.assert_allclose(logits, full, atol=1e-5)
  _alone_equals_batched(dec, variables)
  for kv in ('int8', 'int4'):
    out = Decoder(transformer, length=S, kv=kv).generate(variables, PROMPTS, 6)
    assert [len(t) for t in out.tokens] == [6, 6]
  t = transformer
  q = aqtr.flax.quantize(t, [Rule('int8', path='.*layer.*')])
  ids = jnp.asarray([PROMPTS[0]])
  mask = jnp.tril(jnp.ones((6, 6), bool))[None]
  pos = jnp.arange(6)[None]
  served, svars = aqtr.flax.convert(
    q, ids, pos, None, mask, variables=variables
  )
  want = Decoder(q, length=S).generate(variables, PROMPTS, 6).tokens
  assert Decoder(served, length=S).generate(svars, PROMPTS, 6).tokens == want


class _Vocab:
  """A byte vocabulary standing in for gemma's SentencePiece one."""

  def pad_id(self):
    return 0

  def eos_id(self):
    return 1

  def bos_id(self):
    return 2

  def EncodeAsIds(self, s):  # noqa: N802 (SentencePiece's name)
    return [3 + b % (zoo.VOCAB - 3) for b in s.encode()]

  def DecodeIds(self, ids):  # noqa: N802
    return ' '.join(map(str, ids))


def test_gemmas_own_sampler_runs_with_a_quantized_cache_and_weights():
  from gemma import sampler as sampler_lib  # noqa: PLC0415

  from aqtr.flax.gemma_sampler import SamplerTransformer  # noqa: PLC0415

  _, t, variables = _gemma(2)
  params = variables['params']
  prompts = ['hello', 'hi']

  def run(transformer, p):
    s = sampler_lib.Sampler(transformer, _Vocab(), p, cache_length=S)
    return s(prompts, total_generation_steps=8)

  own = run(t, params)
  same = run(SamplerTransformer(t, 'none'), params)
  assert same.tokens == own.tokens and same.logits == own.logits
  for kv, tol in [('int8', 0.02), ('int4', 0.2)]:
    got = run(SamplerTransformer(t, kv), params)
    a, b = np.asarray(got.logits[0]), np.asarray(own.logits[0])
    err = np.max(np.abs(a - b)) / np.max(np.abs(b))
    assert 0 < err < tol, (kv, err)
  q = aqtr.flax.quantize(t, [Rule('int8', path='.*layer.*')])
  ids = jnp.asarray([PROMPTS[0]])
  mask = jnp.tril(jnp.ones((6, 6), bool))[None]
  served, svars = aqtr.flax.convert(
    q, ids, jnp.arange(6)[None], None, mask, variables=variables
  )
  want = run(q, params)
  got = run(SamplerTransformer(served, 'none'), svars)
  assert got.tokens == want.tokens
  assert (
    run(SamplerTransformer(served, 'int8'), svars).tokens[0][:3]
    == (want.tokens[0][:3])
  )
  with pytest.raises(ValueError, match='matched no cache variable'):
    from aqtr.flax.kv_cache import CacheRule  # noqa: PLC0415

    run(SamplerTransformer(t, CacheRule(path='nothing')), params)


def test_sampling_and_bad_input_on_a_real_lm():
  hf = _hf_model('gpt2')
  dec = Decoder(hf, length=S, kv='int8')
  s = Sampling(temperature=0.7, top_k=5, seed=1)
  a, b = (dec.generate(None, PROMPTS, 5, s).tokens for _ in 'ab')
  assert a == b
  with pytest.raises(ValueError, match='exceeds the 32 positions'):
    Decoder(hf, length=S + 1)
  with pytest.raises(ValueError, match=r'outside the vocabulary \[0, 128\)'):
    dec.generate(None, [[1, 128]], 2)


def _cli(capsys, *args):
  from absl import flags  # noqa: PLC0415

  from aqtr.train.generate_cli import define_flags, main  # noqa: PLC0415

  define_flags()
  flags.FLAGS.unparse_flags()
  with pytest.raises(SystemExit) as e:
    main(['aqtr-generate', *args])
  out, err = capsys.readouterr()
  return e.value.code or 0, out, err


def test_aqtr_generate_decodes_a_stock_lms_exported_checkpoint(
  tmp_path, capsys
):
  from aqtr import checkpoints, presets  # noqa: PLC0415

  hf = _hf_model('llama')
  q = aqtr.flax.quantize(
    hf.module, [Rule(presets.int4_weight_only(), path='.*/layers/.*')]
  )
  served, svars = aqtr.flax.convert(
    q, *_hf_inputs(), variables={'params': hf.params}
  )
  folder = tmp_path / 'llama_int4'
  checkpoints.export(
    served, str(folder), variables=svars, config=hf.config.to_dict()
  )
  status, out, err = _cli(
    capsys,
    f'--checkpoint={folder}',
    '--ids=5,9,2,7',
    '--ids=4,8',
    '--max_new=6',
    '--kv=int8',
    '--kv_scales=block',
    '--kv_block=8',
  )
  assert status == 0, err
  assert "--- '5,9,2,7'" in out and 'tokens/s decoding (batch 2, 6 new' in out
  assert '(int8, 32 slots x 2 sequences' in out
  for args, message in [
    (['--ids=5,x'], "--ids #0: '5,x' is not comma-separated integer"),
    (['--prompt=hi'], 'has no tokenizer; give prompts as token ids'),
    (['--ids=5,128'], r'token 128 is outside the vocabulary [0, 128)'),
    (['--ids=5', '--temperature=nan'], 'temperature must be a finite num'),
    (['--ids=5', '--top_k=500'], 'top_k=500 exceeds the vocabulary size'),
    (['--ids=5', '--cache_len=64'], 'exceeds the 32 positions'),
    (['--ids=5', '--kv=int8', '--kv_scales=block', '--kv_block=5'], 'block'),
    (['--ids=' + ','.join(['1'] * 40)], 'prompt 0 has 40 tokens'),
  ]:
    status, out, err = _cli(capsys, f'--checkpoint={folder}', *args)
    assert status == 2 and out == '', (args, out, err)
    assert len(err.strip().splitlines()) == 1 and message in err, (args, err)
  status, _, err = _cli(capsys, f'--checkpoint={tmp_path}', '--ids=1')
  assert status == 2 and 'has no config.json' in err
