"""The main job's LoRA runs: on the Pax LM and on the stock nnx LM.

  lora              LoRA on the job's LM (`aqtr.pax` template; adapters
                    injected by `aqtr.lora.attach`), float base
  qlora_nf4         QLoRA on the job's LM: nf4 g64 base, double-quantized
                    scales (Dettmers et al. 2023, arXiv 2305.14314)
  stock_lora        LoRA on the stock nnx LM (`aqtr.train.stock_lm`,
                    adapters by interception)
  stock_qlora_nf4   QLoRA on the stock nnx LM

Each fine-tunes a float model: the job's own 'float' run (Pax LM) or
'stock_float' run (stock LM), which then pretrain without the fine-tuning
family (`tasks.make` leaves `Experiment.finetune_family` out of the
corpus), or the checkpoint `Experiment.init_from` names (a job folder, or a
run folder's `float_params`, written when a job has LoRA runs). They train
on the family's train files (`family_split`) with the job's steps and
optimizer, adapters of rank `Experiment.lora_rank` (alpha 2r) on every
block projection (LoRA, Hu et al. 2021, arXiv 2106.09685).

The summary row's bpc is on the family's validation files; the run's
`lora.json` adds the frozen base's bpc, the merged models' (adapters folded
in and re-quantized to the base's format by round to nearest, and solved
by `MERGE_SOLVER` on `ptq_batches` family batches; a float base's merge
is float, nothing to solve) and the bytes of
`aqtr.lora.sizes`.

The runs are `aqtr.train.runs.LoraRun` objects (`stock`: the stock LM,
`base_format`: None or 'nf4', `init_from`: the float run).

Example:
  >>> from aqtr.train import runs
  >>> r = runs.get('stock_qlora_nf4')
  >>> r.stock, r.base_format, r.init_from
  (True, 'nf4', 'stock_float')
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import aqtr.flax.checkpoint as ckpt
from aqtr import lora, ptq
from aqtr.data import loader, stdlib
from aqtr.flax import kinds
from aqtr.train import loop, models, stock_lm
from aqtr.train.tasks import evaluate_logits

__all__ = [
  'BASE_DIR',
  'base_path',
  'check_fields',
  'family_data',
  'family_split',
  'load_base',
  'read',
  'run',
  'save_base',
]

BASE_DIR = 'float_params'  # In the 'float' / 'stock_float' run's folder.
PAX_RULES = r'layers.*'  # Every block projection of the Pax LM.
# How the merged weights are solved (`aqtr.lora.merge`'s arguments): GPTQ
# (arXiv 2210.17323) with act-order on fresh scales (on the job's LM the
# base's grid did worse: +1.6% vs +1.2% bpc after config:long; README).
MERGE_SOLVER = {'method': ptq.Gptq(act_order=True), 'grid': 'fresh'}
STOCK_RULES = r'.*blocks.*'  # ... of the stock LM.


def read(names: list[str], cap: int | None) -> np.ndarray:
  """The stdlib files `names` as bytes, 0 after each (up to `cap`)."""
  base, parts, total = stdlib.root(), [], 0
  for n in names:
    parts.append((base / n).read_bytes().replace(b'\0', b'') + b'\0')
    total += len(parts[-1])
    if cap is not None and total >= cap:
      break
  return np.frombuffer(b''.join(parts), np.uint8)


def family_split(family: str) -> tuple[list[str], list[str]]:
  """(train, validation) stdlib files of package `family` (by file)."""
  fam = [n for n in stdlib.files() if n.startswith(family + '/')]
  if not fam:
    raise ValueError(f'finetune family: no stdlib package {family!r}.')
  train = [n for n in fam if not stdlib.is_validation(n, 20)]
  val = [n for n in fam if stdlib.is_validation(n, 20)]
  return train, val


def family_data(family: str) -> tuple[np.ndarray, np.ndarray]:
  """The (train, validation) bytes of package `family`."""
  train, val = family_split(family)
  return read(train, None), read(val, None)


def save_base(base: Any, run_dir: pathlib.Path) -> pathlib.Path:
  """Saves a float base for `init_from`: the stock LM or the Pax params."""
  path = pathlib.Path(run_dir).absolute() / BASE_DIR
  ckpt.save(path, nnx.state(base) if kinds.is_nnx(base) else base)
  return path


def base_path(init_from: str, base_run: str) -> str:
  """The checkpoint of run `base_run`'s float model: `init_from` may be a
  job folder (then its `<base_run>/float_params`) or the checkpoint."""
  inside = pathlib.Path(init_from) / base_run / BASE_DIR
  return str(inside) if inside.is_dir() else init_from


def load_base(path: str, template: Any, seed: int, *, stock: bool = False):
  """The float base saved by `save_base`: stock LM or Pax LM params."""
  if stock:
    model = stock_lm.StockLm(**stock_lm.sizes(template), rngs=nnx.Rngs(seed))
    nnx.update(model, ckpt.restore(path, nnx.state(model)))
    return model
  x = jnp.zeros((1, 2), jnp.int32)
  shapes = jax.eval_shape(models.build(template).init, jax.random.key(0), x)
  return ckpt.restore(path, shapes['params'])


def _config(run: Any, exp: Any) -> lora.LoraConfig:
  r, base = exp.lora_rank, run.base_format
  return lora.LoraConfig(
    rank=r, alpha=2.0 * r, base=base, double_quant=base is not None
  )


def _finetune(name, exp, apply, params, rest, train, eval_set, emit, bar):
  """Trains `params` (the adapters) with the job's loop: a `loop.Fitted`."""
  # Plain jit (the uint4 codes' layout is fixed at the first call): the
  # compile time is the first step's.
  trainee = loop.Trainee(
    params=params,
    apply=lambda p, s, r, x, step: (apply(p, r, x), s),
    frozen=rest,
    aot=False,
  )
  return loop.fit(
    name,
    trainee,
    loop.optimizer(exp),
    loader.windows(train, exp.batch_size, exp.seq_len, exp.seed),
    loop.Schedule(steps=exp.steps, log_every=exp.log_every),
    eval_set=eval_set,
    items_per_batch=exp.batch_size * exp.seq_len,
    on_record=emit,
    show_progress=bar,
  )


def _bpc(fn, eval_set) -> float:
  return evaluate_logits(fn, eval_set, 'bpc')['bpc']


def _stock(run, exp, base, train, eval_set, emit, bar):
  """LoRA on the stock nnx LM `base`; (trained, numbers)."""
  x0 = jnp.zeros((1, exp.seq_len), jnp.int32)
  model = lora.attach(base, {STOCK_RULES: _config(run, exp)}, x0, seed=exp.seed)
  graphdef, params, rest = nnx.split(model, lora.Adapter, ...)

  def apply(p, r, x):
    return nnx.merge(graphdef, p, r)(x)

  def served(m):  # A model served alone: its own jitted forward.
    g, state = nnx.split(m)
    f = jax.jit(lambda s, x: nnx.merge(g, s)(x))
    return lambda x: f(state, x)

  frozen = _bpc(served(base), eval_set)
  fitted = _finetune(
    run.name, exp, apply, params, rest, train, eval_set, emit, bar
  )
  params = fitted.params
  model = nnx.merge(graphdef, params, rest)
  merged = {'rtn': lora.merge(model, x0)}
  if run.base_format is not None:  # A float merge has nothing to solve.
    cal = _calibration(train, exp)
    merged['gptq'] = lora.merge(model, x0, batches=cal, **MERGE_SOLVER)
  return _Tuned(
    params,
    rest,
    apply,
    served(model),
    frozen,
    {k: served(m) for k, m in merged.items()},
    lora.sizes(model, x0),
    fitted,
  )


def _pax(run, exp, template, float_params, train, eval_set, emit, bar):
  """LoRA on the Pax LM (`template`, float `float_params`)."""
  x0 = jnp.zeros((1, exp.seq_len), jnp.int32)
  lt, lv = lora.attach(
    template,
    {PAX_RULES: _config(run, exp)},
    x0,
    variables={'params': float_params},
    seed=exp.seed,
  )
  module = models.build(lt)
  params, frozen_params = lora.partition(lv['params'])
  rest = dict(lv, params=frozen_params)

  def apply(p, r, x):
    return module.apply(dict(r, params=lora.combine(p, r['params'])), x)

  def served(t, v):  # A template and variables served alone.
    f = jax.jit(models.build(t).apply)
    return lambda x: f(v, x)

  frozen = _bpc(served(template, {'params': float_params}), eval_set)
  fitted = _finetune(
    run.name, exp, apply, params, rest, train, eval_set, emit, bar
  )
  params = fitted.params
  trained = dict(rest, params=lora.combine(params, frozen_params))
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', UserWarning)
    merged = {'rtn': lora.merge(lt, x0, variables=trained)}
    if run.base_format is not None:  # A float merge has nothing to solve.
      cal = _calibration(train, exp)
      merged['gptq'] = lora.merge(
        lt, x0, variables=trained, batches=cal, **MERGE_SOLVER
      )
  return _Tuned(
    params,
    rest,
    apply,
    served(lt, trained),
    frozen,
    {k: served(*m) for k, m in merged.items()},
    lora.sizes(lt, x0, variables=trained),
    fitted,
  )


def _calibration(train: np.ndarray, exp: Any) -> list:
  """`ptq_batches` family training inputs (GPTQ's merge calibration)."""
  got = loader.windows(train, exp.batch_size, exp.seq_len, exp.seed + 1)
  return [jnp.asarray(x) for x, _ in itertools.islice(got, exp.ptq_batches)]


@dataclasses.dataclass
class _Tuned:
  params: Any
  rest: Any
  apply: Any
  serve: Any  # x -> logits of the trained model served alone.
  frozen_bpc: float
  merged: dict  # method -> (x -> logits).
  sizes: lora.Bytes
  fitted: loop.Fitted


def run(
  run: Any,
  exp: Any,
  base: Any,
  run_dir,
  *,
  template=None,
  on_record=None,
  show_progress: bool = False,
):
  """Fine-tunes `base` with LoRA run `run`; (RunResult, serve dict).

  Args:
    run: the `aqtr.train.runs.LoraRun` (name, stock, base_format).
    exp: the Experiment.
    base: the float stock LM (stock runs) or the Pax LM's float params.
    run_dir: the run's folder (`lora.json` is written there).
    template: the Pax LM's float template (Pax runs).
    on_record: called with each metrics record.
    show_progress: draw the progress bar.
  """
  emit = on_record or (lambda r: None)
  train, val = family_data(exp.finetune_family)
  eval_set = loader.eval_windows(
    val, exp.batch_size, exp.seq_len, exp.eval_batches
  )
  data = (train, eval_set, emit, show_progress)
  name = run.name
  if run.stock:
    tuned = _stock(run, exp, base, *data)
  else:
    tuned = _pax(run, exp, template, base, *data)
  fitted = tuned.fitted
  final = fitted.final or {'val_loss': math.nan, 'bpc': math.nan}
  forward = jax.jit(tuned.apply)

  def train_fn(p, x):
    return forward(p, tuned.rest, x)

  same = all(
    bool(np.array_equal(train_fn(tuned.params, x), tuned.serve(x)))
    for x, _ in eval_set
  )
  merged = {k: _bpc(f, eval_set) for k, f in tuned.merged.items()}
  sizes = tuned.sizes
  info = {
    'family': exp.finetune_family,
    'model': 'stock nnx LM' if run.stock else 'Pax LM',
    'bpc': {
      'frozen_base': tuned.frozen_bpc,
      name: final['bpc'],
      **{f'{name}_merged_{k}': v for k, v in merged.items()},
    },
    'bytes': dataclasses.asdict(sizes) | {'ratio_to_full_ft': sizes.ratio},
    'step_s': 1 / fitted.steps_per_s,
  }
  pathlib.Path(run_dir, 'lora.json').write_text(json.dumps(info, indent=1))
  cfg = _config(run, exp)
  rules = STOCK_RULES if run.stock else PAX_RULES
  result = loop.RunResult.of(
    fitted,
    name=name,
    config=run.config(),
    injected=None,
    report=f'{name}: {cfg} on {rules} (family {exp.finetune_family})',
    params=tuned.params,
    final=final,
    logits_fn=train_fn,
    param_opt_bytes=sizes.total,
  )
  serve = {  # Served as trained: frozen base + adapters + other params.
    'serving_bytes': sizes.base + sizes.adapters + sizes.other,
    'float_bytes': sizes.full // 3,
    'serve_equal': same,
    'merged_bpc': merged['rtn'],
    'merged_gptq_bpc': merged.get('gptq'),  # None: a float base.
    'frozen_bpc': tuned.frozen_bpc,
  }
  return result, serve


def check_fields(exp, lora_runs: dict[str, Any]) -> None:
  """Raises one line for bad LoRA fields of Experiment `exp`.

  Args:
    exp: the Experiment.
    lora_runs: {name: its `aqtr.train.runs.LoraRun`} of `exp.runs`.
  """
  names = [n for n in exp.runs if n in lora_runs]
  if not names:
    return
  if exp.task != 'lm':
    raise ValueError(
      f"runs: {', '.join(names)} need task 'lm', got {exp.task!r}."
    )
  if exp.init_from is not None and not isinstance(exp.init_from, str):
    raise ValueError(
      f'init_from must be a checkpoint path or None, got {exp.init_from!r}.'
    )
  for i, n in enumerate(exp.runs):
    want = lora_runs[n].init_from if n in lora_runs else None
    if want and exp.init_from is None and want not in exp.runs[:i]:
      model = 'stock LM' if lora_runs[n].stock else 'LM'
      raise ValueError(
        f'runs: {n!r} fine-tunes the float {model}: put {want!r} before it '
        f"in runs, or set init_from=<a job's folder or its "
        f'{want}/{BASE_DIR}>.'
      )
  if not isinstance(exp.finetune_family, str) or not exp.finetune_family:
    raise ValueError(
      'finetune_family must name a stdlib package (e.g. email), got '
      f'{exp.finetune_family!r}.'
    )
  group = lora.nf4().fwd.rhs.tiling.tile_size
  nf4 = [n for n in names if lora_runs[n].base_format == 'nf4']
  if nf4 and exp.model is not None:
    d = stock_lm.sizes(exp.model)['d_model']
    if d % group:
      raise ValueError(
        f'runs: {nf4[0]!r} stores nf4 weights in groups of {group} inputs '
        f"but the LM's d_model is {d}; use a model with d_model a multiple "
        f'of {group} (e.g. config:default).'
      )
