"""papers.lib: the shared command line, tasks and MLP trainer."""

import doctest
import importlib
import pathlib

import pytest

import aqtr
from papers.int8_training_matches_float import config
from papers.lib import cli, mlp, tasks


def test_cli_takes_aqtr_train_config_flags():
  cfg, out = cli.parse(
    config,
    [
      'run',
      '--config=config:small',
      "--config=set:tasks['teacher'].steps=5",
      "--config=fiddler:add_run('int6', 'fully_quantized', 6, 6)",
      '--config=fiddler:use_rounding(r"runs\\[\'int6\'\\]\\.dlhs\\.lhs", '
      "'stochastic')",
      '--out_dir=/tmp/x',
    ],
  )
  assert cfg.tasks['teacher'].steps == 5
  assert cfg.runs['int6'].fwd.lhs.numerics.bits == 6
  assert type(cfg.runs['int6'].dlhs.lhs.rounding).__name__ == 'Config'
  assert out == '/tmp/x'


def test_cli_saves_and_rereads_a_config(tmp_path):
  path = tmp_path / 'c.json'
  cfg, _ = cli.parse(
    config,
    [
      'run',
      '--config=config:small',
      '--config=set:tasks["digits"].steps=9',
      f'--save_config={path}',
    ],
  )
  again, _ = cli.parse(config, ['run', f'--config=config_file:{path}'])
  assert again == cfg and again.tasks['digits'].steps == 9


def test_cli_defaults_to_full():
  cfg, out = cli.parse(config, ['run'])
  assert cfg.tasks['digits'].seeds == (0, 1, 2) and out is None


@pytest.mark.parametrize(
  'kw, match',
  [
    ({'name': 'mnist'}, 'Task.name must be one of'),
    ({'steps': 0}, 'Task.steps must be >= 1'),
    ({'seeds': ()}, 'Task.seeds'),
    ({'teacher_dims': (4,)}, 'Task.teacher_dims'),
  ],
)
def test_task_rejects_bad_fields(kw, match):
  with pytest.raises(ValueError, match=match):
    tasks.Task(**kw)


def test_same_seed_same_result_and_serving_is_exact():
  task = tasks.Task(
    name='teacher', hidden=(8,), steps=20, train_size=128, val_size=64
  )
  a = mlp.run(task, aqtr.presets.int8(), seed=3)
  b = mlp.run(task, aqtr.presets.int8(), seed=3)
  assert a['metric'] == b['metric'] and a['serve_equal']


def test_readme_lists_every_claim_and_done_claims_are_complete():
  root = pathlib.Path(config.__file__).parents[1]
  readme = (root / 'README.md').read_text()
  claims = [p for p in root.iterdir() if p.is_dir() and p.name != 'lib']
  claims = [p for p in claims if not p.name.startswith(('_', '.'))]
  assert len(claims) >= 6
  tests = pathlib.Path(__file__).parent
  for p in claims:
    assert f'[{p.name}]({p.name}/README.md)' in readme, p.name
    text = (p / 'README.md').read_text()
    assert 'arXiv' in text or 'google/aqt' in text, p.name
    if (p / 'run.py').exists():  # done: config, outputs, test, command
      for f in ('config.py', 'results.md', 'results.png'):
        assert (p / f).exists(), f'{p.name}/{f}'
      assert (tests / f'test_{p.name}.py').exists(), p.name
      assert f'python -m papers.{p.name}.run' in text, p.name
    else:
      assert '**Status: pending**' in text, p.name


_MODULES = [
  'papers.lib.claim',
  'papers.lib.cli',
  'papers.lib.compare',
  'papers.lib.mlp',
  'papers.lib.plots',
  'papers.lib.tasks',
  'papers.calibration_shootout.config',
  'papers.calibration_shootout.shootout',
  'papers.four_bit_pareto.config',
  'papers.four_bit_pareto.sweep',
  'papers.fp8_formats_and_scaling.config',
  'papers.int8_training_matches_float.config',
  'papers.microscaling_formats.config',
  'papers.microscaling_formats.formats',
  'papers.nvfp4_training_recipe.lm_ablation',
  'papers.nvfp4_training_recipe.lm_config',
  'papers.qt_needs_stochastic_rounding.config',
  'papers.qt_needs_stochastic_rounding.sweep',
]


@pytest.mark.parametrize('name', _MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
  assert result.failed == 0, f'{result.failed} doctest(s) failed in {name}'


@pytest.mark.parametrize(
  'claim',
  [
    'int8_training_matches_float',
    'fp8_formats_and_scaling',
    'four_bit_pareto',
  ],
)
@pytest.mark.parametrize('size', ['full', 'small'])
def test_configs_build(claim, size):
  module = importlib.import_module(f'papers.{claim}.config')
  exp = aqtr.fiddle.build(getattr(module, size)())
  assert exp.runs and all(
    isinstance(c, aqtr.DotGeneralConfig) for c in exp.runs.values()
  )


@pytest.mark.parametrize(
  'claim',
  [
    'qt_needs_stochastic_rounding',
    'calibration_shootout',
    'microscaling_formats',
  ],
)
@pytest.mark.parametrize('size', ['full', 'small'])
def test_other_configs_build(claim, size):
  module = importlib.import_module(f'papers.{claim}.config')
  exp = aqtr.fiddle.build(getattr(module, size)())
  assert type(exp).__module__.startswith(f'papers.{claim}.')


def test_cli_finds_shared_fiddlers_without_imports():
  from papers.qt_needs_stochastic_rounding import config as qt_config

  assert not hasattr(qt_config, 'use_rounding')
  cfg, _ = cli.parse(
    qt_config,
    ['run', '--config=config:small', '--config=set:learning_rates=(3e-4,)'],
  )
  assert cfg.learning_rates == (3e-4,)
  ns = cli.namespace(qt_config)
  assert ns.small is qt_config.small and callable(ns.use_numerics)


def test_traced_learning_rate_trains_like_the_static_one():
  task = tasks.Task(
    name='teacher', hidden=(8,), steps=30, train_size=128, val_size=64
  )
  a = mlp.run(task, aqtr.presets.float(), 0, check_serving=False)
  b = mlp.run(task, aqtr.presets.float(), 0, check_serving=False, trace_lr=True)
  assert b['metric'] == pytest.approx(a['metric'], rel=1e-4)


def test_qt_weights_stay_quantized():
  from aqtr import qt

  task = tasks.Task(name='digits', hidden=(32,), steps=5)
  r = mlp.run(
    task,
    aqtr.presets.float(),
    0,
    check_serving=False,
    weights=qt.int8(),
    rounding='nearest',
  )
  assert all(isinstance(p['w'], qt.QTParam) for p in r['params'])
  with pytest.raises(ValueError, match='check_serving must be False'):
    mlp.run(task, aqtr.presets.float(), 0, weights=qt.int8())
