"""papers/nvfp4_training_recipe's LM ablation: the checks and a tiny run."""

import pathlib

import pytest

from aqtr.train import report
from papers.nvfp4_training_recipe import lm_ablation, lm_config, lm_run


def _row(run, gap, sd=0.002):
  return {'run': run, 'gap': gap, 'gap sd': sd}


def test_check_reads_the_claim_off_the_rows():
  rows = [
    _row('float', 0.0, 0.0),
    _row('fp8', -0.001),
    _row('nvfp4_naive', 0.05),
    _row('nvfp4_recipe', 0.01),
    _row('nvfp4_recipe_no_rht', 0.02),
    _row('nvfp4_recipe_no_sr', 0.011),
    _row('nvfp4_recipe_no_2d', 0.0),
  ]
  got = {s: v for s, v, _ in lm_ablation.check(rows)}
  assert got['recipe beats naive NVFP4'] is True
  assert got['recipe is the NVFP4 run closest to fp8'] is False  # no_2d
  assert got["recipe's gap <= 2x fp8's"] is False
  assert got['removing RHT-16 on the wgrad inputs'] == 'hurts'
  assert got['removing stochastic rounding of the gradients'] == 'within noise'
  assert got['removing 16x16 weight blocks (1x16 instead)'] == 'helps'
  assert 'removing the high-precision layers' not in got  # Not run.
  numbers = dict((s, n) for s, _, n in lm_ablation.check(rows))
  assert 'fp8 within its noise of 0' in numbers["recipe's gap <= 2x fp8's"]


def test_config_and_bad_input():
  cfg = lm_config.full()
  assert cfg.experiment.runs == lm_ablation.RUNS and cfg.seeds == (0, 1)
  with pytest.raises(ValueError, match=r'LmAblation.seeds must be ints >= 0'):
    lm_ablation.LmAblation(seeds=())
  cfg.experiment.runs = ('fp8', 'float')
  with pytest.raises(ValueError, match=r"must start with 'float'"):
    lm_ablation.run(cfg, pathlib.Path('/nonexistent'))


def test_readme_has_the_lm_table():
  text = (pathlib.Path(lm_config.__file__).parent / 'README.md').read_text()
  assert 'python -m papers.nvfp4_training_recipe.lm_run' in text
  table = pathlib.Path(lm_config.__file__).parent / 'lm' / 'results.md'
  runs = [r['run'] for r in report.parse_table(table.read_text())]
  assert runs == list(lm_ablation.RUNS)


@pytest.mark.slow
def test_small_run_writes_table_checks_and_plot(tmp_path):
  rows = lm_run.run(lm_config.small(), tmp_path, echo=False)
  assert [r['run'] for r in rows] == ['float', 'nvfp4_naive', 'nvfp4_recipe']
  assert rows[0]['gap'] == 0 and all(r['serve==train'] for r in rows)
  text = (tmp_path / 'results.md').read_text()
  assert 'recipe beats naive NVFP4' in text
  assert (tmp_path / 'results.png').read_bytes()[:4] == b'\x89PNG'
