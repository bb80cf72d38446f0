"""The main job: train every run of an experiment, serve, and report.

`run(cfg, out_dir)` trains float and quantized runs of one model on the
same data, evaluates them periodically, converts each weight-quantized run
to a serving checkpoint and checks serve == train, then writes the outputs
(`aqtr.train.report`) and returns the summary rows.

Example:
  >>> from aqtr.train import experiment, job
  >>> cfg = experiment.tiny()
  >>> cfg.steps, cfg.runs = 2, ('float',)
  >>> rows = job.run(cfg, '/tmp/aqtr_doctest', show_progress=False,
  ...                echo=False)  # doctest: +SKIP
  >>> rows[0]['run'], rows[0]['serve==train']  # doctest: +SKIP
  ('float', '-')
"""

from __future__ import annotations

import json
import pathlib
import sys
import time
import warnings
from typing import Any

import fiddle as fdl

import aqtr
from aqtr import fiddle as aqtr_fiddle
from aqtr.flax import common
from aqtr.train import experiment, loop, models, report, serving, tasks

__all__ = ['columns', 'resolved', 'run']


def columns(metric: str) -> list[str]:
  """The summary table's columns for a task metric ('bpc' or 'accuracy')."""
  return [
    'run',
    'train loss',
    'val loss',
    metric,
    'steps/s',
    'x float',
    'compile s',
    'serving KB',
    'x params',
    'serve==train',
  ]


FORMATS = {
  'steps/s': '.2f',
  'x float': '.2f',
  'compile s': '.1f',
  'serving KB': '.1f',
  'x params': '.3f',
}


def _config_of(name: str, custom: Any) -> aqtr.DotGeneralConfig:
  return custom if name == 'custom' else getattr(aqtr.presets, name)()


def resolved(
  cfg: fdl.Config, exp: experiment.Experiment | None = None
) -> fdl.Config:
  """`cfg` with every field set (defaults included), the model resolved."""
  if exp is None:
    exp = experiment.split(cfg)[0]
  out = aqtr_fiddle.as_config(
    experiment.Experiment(
      **{
        k: getattr(exp, k)
        for k in exp.__dataclass_fields__
        if k not in ('model', 'custom')
      }
    )
  )
  out.model = exp.model
  out.custom = cfg.custom
  return out


def _write_config(out: pathlib.Path, cfg: fdl.Config, exp, runs) -> None:
  full = resolved(cfg, exp)
  lines = ['# experiment (one line per leaf)', aqtr_fiddle.to_text(full)]
  for name, config in runs:
    lines += [
      '',
      f'# run {name!r}: DotGeneralConfig of every weight op',
      aqtr_fiddle.to_text(config),
    ]
  (out / 'config.txt').write_text('\n'.join(lines) + '\n')
  try:
    text = aqtr_fiddle.dumps(full)
  except Exception as e:  # A custom model may not serialize.
    warnings.warn(f'config.json not written: {e}', stacklevel=2)
    return
  (out / 'config.json').write_text(text)


def _row(
  r: loop.RunResult,
  metric: str,
  base: loop.RunResult | None,
  serve: dict[str, Any] | None,
  float_bytes: int,
) -> dict[str, Any]:
  kb = (serve['serving_bytes'] if serve else float_bytes) / 1024
  return {
    'run': r.name,
    'train loss': r.train_loss,
    'val loss': r.final['val_loss'],
    metric: r.final[metric],
    'steps/s': r.steps_per_s,
    'x float': r.steps_per_s / base.steps_per_s if base else None,
    'compile s': r.compile_s,
    'serving KB': kb,
    'x params': kb * 1024 / float_bytes,
    'serve==train': serve['serve_equal'] if serve else '-',
  }


def run(
  cfg: fdl.Config,
  out_dir: str | pathlib.Path,
  *,
  show_progress: bool = True,
  echo: bool = True,
) -> list[dict[str, Any]]:
  """Runs the experiment `cfg` and writes its outputs to `out_dir`.

  Args:
    cfg: `fdl.Config(Experiment)` (see `aqtr.train.experiment`).
    out_dir: output folder (created; files in it are overwritten).
    show_progress: draw progress bars (stderr).
    echo: print the data line, per-run serving checks and the summary.

  Returns:
    The summary rows (dicts keyed by `columns(metric)`).
  """
  say = print if echo else (lambda *a, **k: None)
  t_start = time.perf_counter()
  exp, template, custom = experiment.split(cfg)
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  task = tasks.make(exp)
  runs = [(n, _config_of(n, custom)) for n in exp.run_names]
  _write_config(out, cfg, exp, runs)
  say(f'aqtr-train: {exp.task}, {task.info}')
  say(f'output: {out.absolute()}', flush=True)
  params = loop.init_params(template, task, exp.seed)
  float_bytes = common.nbytes(params)
  results, rows, records = [], [], []
  base = None
  with report.Metrics(out / 'metrics.jsonl') as metrics:

    def on_record(rec):
      records.append(rec)
      metrics.write(rec)

    for name, config in runs:
      r = loop.train(
        name,
        config,
        exp,
        task,
        template,
        params=params,
        on_record=on_record,
        show_progress=show_progress,
      )
      run_dir = out / name
      run_dir.mkdir(exist_ok=True)
      (run_dir / 'injection.txt').write_text(str(r.report) + '\n')
      serve = None
      if models.has_frozen_weights(r.injected):
        serve = serving.check(
          r.injected,
          r.params,
          config,
          r.logits_fn,
          task.eval_set,
          run_dir / 'serving',
        )
        (run_dir / 'serving.json').write_text(json.dumps(serve, indent=1))
        say(
          f'  {name}: serving checkpoint {serve["checkpoint"]}: '
          f'{serve["serving_bytes"] / 1024:.1f} KB, serve == train: '
          f'{serve["serve_equal"]} (max |diff| {serve["max_abs_diff"]:g})',
          flush=True,
        )
      if name == 'float':
        base = r
      results.append(r)
      rows.append(_row(r, task.metric, base, serve, float_bytes))
      metrics.write({'run': name, 'summary': rows[-1]})
  cols = columns(task.metric)
  text = report.table(rows, cols, FORMATS)
  (out / 'summary.md').write_text(text + '\n')
  (out / 'summary.json').write_text(json.dumps(rows, indent=1))
  report.plot(
    records,
    out / 'loss.png',
    f'{exp.task}: {task.info.split(":")[0]}, {exp.steps} steps',
  )
  say('')
  say(text)
  say(
    f'\n{len(runs)} run(s) in {time.perf_counter() - t_start:.0f} s; '
    f'outputs in {out}',
    flush=True,
  )
  sys.stdout.flush()
  return rows
