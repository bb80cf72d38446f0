"""papers/nvfp4_training_recipe at a reduced size: the table and its order."""

import pathlib

import pytest

from aqtr.train import report
from papers.nvfp4_training_recipe import config, run


@pytest.fixture(scope='module')
def result(tmp_path_factory):
  out = tmp_path_factory.mktemp('nvfp4')
  cfg = config.small()
  cfg.runs = {k: cfg.runs[k] for k in ('float', 'nvfp4_naive', 'nvfp4_recipe')}
  cfg.task.steps = 60
  rows = run.run(cfg, out, echo=False)
  return {r['run']: r for r in rows}, out


def test_recipe_trains_and_naive_is_no_better(result):
  rows, _ = result
  assert rows['float']['gap to float'] == 0
  assert rows['nvfp4_recipe']['val MSE'] <= rows['nvfp4_naive']['val MSE']


def test_writes_table_plot_and_config(result):
  rows, out = result
  table = report.parse_table((out / 'results.md').read_text())
  assert [r['run'] for r in table] == list(rows)
  assert (out / 'results.png').read_bytes()[:4] == b'\x89PNG'
  assert 'nvfp4_training' in (out / 'config.txt').read_text()


def test_bad_task_is_rejected():
  from papers.lib.tasks import Task
  from papers.nvfp4_training_recipe.ablation import Ablation, Run

  with pytest.raises(ValueError, match="Ablation.task.name must be 'teacher'"):
    Ablation(task=Task(name='digits'), runs={'float': Run()})


def test_readme_states_claim_command_and_numbers():
  text = (pathlib.Path(config.__file__).parent / 'README.md').read_text()
  assert 'python -m papers.nvfp4_training_recipe.run' in text
  assert 'results.png' in text and 'arXiv' in text


@pytest.mark.slow
def test_full_size_matches_readme(tmp_path):
  rows = {r['run']: r for r in run.run(config.full(), tmp_path, echo=False)}
  gap = {k: r['gap to float'] for k, r in rows.items()}
  assert gap['nvfp4_recipe'] < gap['nvfp4_naive']
  assert gap['recipe - float layers'] > gap['nvfp4_recipe']
  assert gap['fp8'] < gap['nvfp4_recipe']
