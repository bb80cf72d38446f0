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

import aqtr.pax
from aqtr import fiddle as aqtr_fiddle
from aqtr.pax.host import is_template
from aqtr.train import (
  experiment,
  generate,
  loop,
  models,
  report,
  runs,
  tasks,
)
from aqtr.train import mesh as mesh_lib

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
    'param+optimizer MB',
  ]


FORMATS = {
  'steps/s': '.2f',
  'x float': '.2f',
  'compile s': '.1f',
  'serving KB': '.1f',
  'x params': '.3f',
  'param+optimizer MB': '.3f',
}


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


def _write_config(out: pathlib.Path, cfg: fdl.Config, exp, run_list) -> None:
  full = resolved(cfg, exp)
  lines = ['# experiment (one line per leaf)', aqtr_fiddle.to_text(full)]
  for name, config in run_list:
    keep = runs.get(name).keep(exp)
    kept = f' but {keep.label()} (float)' if keep and keep.any else ''
    lines += [
      '',
      f'# run {name!r}: DotGeneralConfig of every weight op{kept}',
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
  if r.diverged:
    row = dict.fromkeys(columns(metric))
    row.update({'run': r.name, 'train loss': 'diverged'})
    return {**row, 'serve==train': '-', 'status': r.diverged}
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
    'status': 'ok',
    'param+optimizer MB': r.param_opt_bytes / 2**20,
  }


def _samples(r, exp, run_dir: pathlib.Path, served: bool) -> list | None:
  """The run's generated samples (from its serving checkpoint if any)."""
  if exp.task != 'lm' or not exp.sample_tokens or r.diverged:
    return None
  if not is_template(r.injected):
    return None  # A stock nnx model: no decoding path.
  if fdl.get_callable(r.injected) is not aqtr.pax.TransformerLm:
    return None  # A custom model: no decoding path.
  if not served and aqtr.pax.needs_key(r.config):
    return None  # Its training forward draws stochastic-rounding keys.
  if served and (run_dir / 'serving' / 'model.json').is_file():
    s = generate.load(run_dir / 'serving')
    model, variables, source = s.model, s.variables, 'serving checkpoint'
  else:
    model = models.build(r.injected)
    variables = {'params': r.params, **r.collections}
    source = 'training model'
  out = generate.samples(model, variables, max_new=exp.sample_tokens)
  return [(r.name, source, *sample) for sample in out]


def _samples_md(samples: list) -> str:
  lines = [
    '',
    f'## Samples (prompt {generate.PROMPT!r}, float KV cache)',
    '',
  ]
  for run, source, how, text, _ in samples:
    lines.append(f'- {run} ({source}), {how}: {text!r}')
  stopped = next((s[-1] for s in samples if s[-1]), None)
  if stopped:
    lines += ['', f"Cut short by the model's max_len positions: {stopped}"]
  return '\n'.join(lines)


def _write_summary(
  out: pathlib.Path, rows: list, metric: str, samples: list = ()
) -> str:
  text = report.table(rows, columns(metric), FORMATS)
  extra = _samples_md(samples) + '\n' if samples else ''
  (out / 'summary.md').write_text(text + '\n' + extra)
  (out / 'summary.json').write_text(json.dumps(rows, indent=1))
  return text


def run(
  cfg: fdl.Config,
  out_dir: str | pathlib.Path,
  *,
  show_progress: bool = True,
  echo: bool = True,
  overwrite: bool = False,
) -> list[dict[str, Any]]:
  """Runs the experiment `cfg` and writes its outputs to `out_dir`.

  A run whose loss or parameters become non-finite stops early and is
  reported as diverged (row 'status'); the other runs go on. Interrupted
  (KeyboardInterrupt), the job writes the summary of the finished runs
  and leaves `INCOMPLETE` in the folders of what did not finish.

  Args:
    cfg: `fdl.Config(Experiment)` (see `aqtr.train.experiment`).
    out_dir: output folder: created, or empty (see `overwrite`).
    show_progress: draw progress bars (stderr).
    echo: print the data line, per-run serving checks and the summary.
    overwrite: clear `out_dir` when it holds an earlier job's output
      (`report.prepare_out_dir`); otherwise a non-empty one is refused.

  Returns:
    The summary rows (dicts keyed by `columns(metric)`, plus 'status':
    'ok' or why the run diverged).

  Raises:
    report.OutDirError: `out_dir` is not empty or cannot be created.
  """
  say = print if echo else (lambda *a, **k: None)
  t_start = time.perf_counter()
  exp, template, custom = experiment.split(cfg)
  if exp.distributed:
    mesh_lib.initialize_distributed()
  out = report.prepare_out_dir(out_dir, overwrite)
  job_marker = report.mark_incomplete(out, 'this job')
  say(f'output: {out.absolute()}', flush=True)
  task = tasks.make(exp)
  run_list = [(n, runs.get(n).dot_config(exp)) for n in exp.run_names]
  _write_config(out, cfg, exp, run_list)
  say(f'aqtr-train: {exp.task}, {task.info}', flush=True)
  params = loop.init_params(template, task, exp.seed)
  rows, records, samples = [], [], []
  base = None  # The baseline run ('x float').
  try:
    with report.Metrics(out / 'metrics.jsonl') as metrics:

      def on_record(rec):
        records.append(rec)
        metrics.write(rec)

      ctx = runs.Context(
        exp=exp,
        task=task,
        template=template,
        params=params,
        run_dir=out,
        say=say,
        on_record=on_record,
        show_progress=show_progress,
      )
      for name, _ in run_list:
        run_obj = runs.get(name)
        ctx.run_dir = out / name
        ctx.run_dir.mkdir()
        marker = report.mark_incomplete(ctx.run_dir, f'run {name!r}')
        outcome = run_obj.execute(ctx)
        r = outcome.result
        for step in run_obj.post:
          runs.POST[step](run_obj, ctx, outcome)
        if r.diverged:
          say(f'  {name}: DIVERGED ({r.diverged}); the other runs go on.')
        served = outcome.serve is not None
        samples += _samples(r, exp, ctx.run_dir, served) or []
        if run_obj.baseline and not r.diverged:
          base = r
        row = _row(r, task.metric, base, outcome.serve, outcome.float_bytes)
        rows.append(row)
        metrics.write({'run': name, 'summary': rows[-1]})
        marker.unlink()
    for late in ctx.late:  # E.g. the PTQ stage of the float run.
      rows += late()
  except KeyboardInterrupt:
    if rows:
      _write_summary(out, rows, task.metric, samples)
    raise
  text = _write_summary(out, rows, task.metric, samples)
  report.plot(
    records,
    out / 'loss.png',
    f'{exp.task}: {task.info.split(":")[0]}, {exp.steps} steps',
  )
  say('')
  say(text)
  for row in rows:
    if row['status'] != 'ok':
      what = row.get('failure', 'DIVERGED')  # a PTQ stage says FAILED
      say(f'{row["run"]} {what}: {row["status"]} (its numbers are not shown)')
  say(
    f'\n{len(run_list)} run(s) in {time.perf_counter() - t_start:.0f} s; '
    f'outputs in {out}',
    flush=True,
  )
  job_marker.unlink()
  sys.stdout.flush()
  return rows
