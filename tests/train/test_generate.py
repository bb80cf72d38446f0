"""Generation from serving checkpoints: served == trained, aqtr-generate."""

import copy
import dataclasses

import jax
import numpy as np
import pytest
from absl import flags

import aqtr
from aqtr.pax.kv_cache import KVCacheConfig
from aqtr.train import experiment, generate, models, serving
from aqtr.train.generate_cli import define_flags, main


@pytest.fixture(scope='module')
def ckpt(tmp_path_factory):
  """A tiny LM's int8 serving checkpoint (random params, not trained)."""
  template = experiment.split(experiment.tiny())[1]
  config = aqtr.presets.int8()
  injected, _ = models.inject(template, config)
  model = models.build(injected)
  x = np.asarray(
    jax.random.randint(jax.random.key(1), (2, template.max_len), 0, 256)
  )
  params = jax.jit(model.init)(jax.random.key(0), x)['params']
  out = tmp_path_factory.mktemp('gen') / 'int8' / 'serving'
  info = serving.check(
    injected,
    params,
    config,
    jax.jit(lambda p, x: model.apply({'params': p}, x)),
    [(x, x)],
    out,
    model=template,
  )
  assert info['serve_equal']
  return out, template, config, model, params


def test_greedy_from_served_int8_equals_training_model_bit_for_bit(ckpt):
  path, _, _, model, params = ckpt
  served = generate.load(path)
  assert served.weight_bytes < 0.6 * jax.tree.reduce(
    lambda a, x: a + x.nbytes, params, 0
  )
  prompts = [generate.encode('def f('), generate.encode('import')]
  for kv in (KVCacheConfig(numerics='int8'),):
    a = generate.decoder(served.model, kv)
    b = generate.decoder(model, kv)
    ids, start = a.pad(prompts)
    la = a.prefill(served.variables, ids, start)[0]
    lb = b.prefill({'params': params}, ids, start)[0]
    np.testing.assert_array_equal(la, lb)
    ga = a.generate(served.variables, prompts, 12).tokens
    gb = b.generate({'params': params}, prompts, 12).tokens
    assert ga == gb


def test_another_model_or_config_is_refused(ckpt, tmp_path):
  path, template, config, _, _ = ckpt
  other = copy.deepcopy(template)
  other.layers[0].attention.num_heads = 4
  with pytest.raises(ValueError, match='another model than the one given'):
    generate.load(path, template=other)
  with pytest.raises(ValueError, match='another config than the one given'):
    generate.load(path, config=aqtr.presets.fp8())
  # A checkpoint whose model.json names another model: the variables do
  # not fit, said in one line.
  bad = tmp_path / 'serving'
  bad.mkdir()
  (bad / 'variables').symlink_to(path / 'variables')
  (bad / 'config.json').write_text((path / 'config.json').read_text())
  wider = copy.deepcopy(template)
  wider.layers[0].ffn.wi.features = 256
  (bad / 'model.json').write_text(aqtr.fiddle.dumps(wider))
  with pytest.raises(ValueError, match='do not fit') as e:
    generate.load(bad)
  assert '\n' not in str(e.value)
  (bad / 'model.json').write_text(aqtr.fiddle.dumps(models.mlp(10)))
  with pytest.raises(ValueError, match='not a TransformerLm'):
    generate.load(bad)
  (bad / 'model.json').unlink()
  with pytest.raises(ValueError, match='no model.json'):
    generate.load(bad)


def _main(capsys, *args):
  define_flags()
  flags.FLAGS.unparse_flags()
  with pytest.raises(SystemExit) as e:
    main(['aqtr-generate', *args])
  out, err = capsys.readouterr()
  return e.value.code or 0, out, err


def test_command_prints_text_speed_and_memory(ckpt, capsys):
  status, out, err = _main(
    capsys,
    f'--serving={ckpt[0]}',
    '--prompt=def ',
    '--prompt=class A',
    '--max_new=5',
    '--kv=int8',
    '--kv_read=int8_dots',
  )
  assert status == 0, err
  assert "--- 'def '" in out and "--- 'class A'" in out
  assert 'tokens/s decoding (batch 2, 5 new tokens each' in out
  assert 'memory: weights' in out and 'KV cache' in out and '(int8,' in out


def test_command_says_when_the_cache_is_full(ckpt, capsys):
  status, out, _ = _main(capsys, f'--serving={ckpt[0]}', '--max_new=100')
  assert status == 0
  assert 'note: the cache is full (32 slots)' in out


@pytest.mark.parametrize(
  'args, message',
  [
    (['--max_new=0'], '--max_new must be >= 1, got 0'),
    (['--temperature=-0.5'], '--temperature must be a finite number >= 0'),
    (['--temperature=nan'], '--temperature must be a finite number >= 0'),
    (['--temperature=inf'], '--temperature must be a finite number >= 0'),
    (['--top_k=-1'], '--top_k must be >= 0, got -1'),
    (['--top_k=257'], 'top_k=257 exceeds the vocabulary size 256'),
    (['--prompt='], 'prompt 0 is empty'),
    (['--prompt=' + 'x' * 40], 'prompt 0 has 40 tokens; the cache holds 32'),
    (['--prompt=ab', '--prompt=' + 'y' * 33], 'prompt 1 has 33 tokens'),
    (['--kv=int3'], 'KVCacheConfig.numerics must be one of'),
    (['--cache_len=64'], "length=64 exceeds the model's max_len=32"),
    (['--kv=int8', '--kv_scales=block', '--kv_block=5'], 'multiple of'),
    (['--kv=int8', '--kv_bound=-1'], '--kv_bound must be a finite bound > 0'),
    (['--kv=int8', '--kv_bound=nan'], '--kv_bound must be a finite bound'),
  ],
)
def test_mistakes_exit_2_with_one_line(ckpt, capsys, args, message):
  status, out, err = _main(capsys, f'--serving={ckpt[0]}', *args)
  assert status == 2 and out == ''
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('aqtr-generate: '), err
  assert message in lines[0]


def test_nan_weights_exit_2_with_one_line(ckpt, capsys, monkeypatch):
  real = generate.load

  def nan_load(path):
    served = real(path)
    nan = jax.tree.map(
      lambda x: x * np.nan if np.issubdtype(x.dtype, np.floating) else x,
      served.variables,
    )
    return dataclasses.replace(served, variables=nan)

  monkeypatch.setattr(generate, 'load', nan_load)
  status, out, err = _main(capsys, f'--serving={ckpt[0]}', '--max_new=2')
  assert status == 2 and out == ''
  assert len(err.strip().splitlines()) == 1
  assert 'non-finite logits (NaN or inf)' in err and 'NaN or inf weights' in err


def test_missing_or_wrong_serving_folder(capsys, tmp_path):
  for args, message in [
    ([], '--serving: give <out>/<run>/serving'),
    ([f'--serving={tmp_path}'], 'not a serving checkpoint'),
  ]:
    status, _, err = _main(capsys, *args)
    assert status == 2 and message in err and len(err.splitlines()) == 1


def test_a_broken_model_json_names_the_file(ckpt, capsys, tmp_path):
  path = ckpt[0]
  bad = tmp_path / 'serving'
  bad.mkdir()
  (bad / 'variables').symlink_to(path / 'variables')
  (bad / 'config.json').write_text((path / 'config.json').read_text())
  (bad / 'model.json').write_text((path / 'model.json').read_text()[:-20])
  with pytest.raises(ValueError, match=r'model.json: cannot be read as the'):
    generate.load(bad)
  status, _, err = _main(capsys, f'--serving={bad}')
  assert status == 2 and 'model.json: cannot be read' in err
  assert len(err.splitlines()) == 1
