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
by `MERGE_SOLVER` on `ptq_batches` family batches) and the bytes of
`aqtr.lora.sizes`.

Example:
  >>> sorted(RUNS)
  ['lora', 'qlora_nf4', 'stock_lora', 'stock_qlora_nf4']
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import pathlib
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import aqtr
import aqtr.flax.checkpoint as ckpt
from aqtr import lora, ptq
from aqtr.data import loader, stdlib
from aqtr.train import loop, models, stock_lm
from aqtr.train.tasks import cross_entropy, evaluate_logits

__all__ = [
  'BASE_DIR',
  'RUNS',
  'base_path',
  'check_fields',
  'family_data',
  'family_split',
  'is_stock',
  'load_base',
  'read',
  'run',
  'save_base',
]

RUNS = {
  'lora': None,
  'qlora_nf4': 'nf4',
  'stock_lora': None,
  'stock_qlora_nf4': 'nf4',
}
BASE_DIR = 'float_params'  # In the 'float' / 'stock_float' run's folder.
PAX_RULES = r'layers.*'  # Every block projection of the Pax LM.
# How the merged weights are solved (`aqtr.lora.merge`'s arguments): GPTQ
# (arXiv 2210.17323) with act-order on fresh scales (on the job's LM the
# base's grid did worse: +1.6% vs +1.2% bpc after config:long; README).
MERGE_SOLVER = {'method': ptq.Gptq(act_order=True), 'grid': 'fresh'}
STOCK_RULES = r'.*blocks.*'  # ... of the stock LM.


def is_stock(name: str) -> bool:
  """Whether LoRA run `name` fine-tunes the stock nnx LM."""
  return name.startswith('stock_')


def base_run(name: str) -> str:
  """The run whose float model LoRA run `name` fine-tunes."""
  return 'stock_float' if is_stock(name) else 'float'


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
  ckpt.save(path, nnx.state(base) if isinstance(base, nnx.Module) else base)
  return path


def base_path(init_from: str, name: str) -> str:
  """The checkpoint of run `name`'s base: `init_from` may be a job folder."""
  inside = pathlib.Path(init_from) / base_run(name) / BASE_DIR
  return str(inside) if inside.is_dir() else init_from


def load_base(path: str, template: Any, seed: int, name: str = 'lora'):
  """The float base saved by `save_base`: stock LM or Pax LM params."""
  if is_stock(name):
    model = stock_lm.StockLm(**stock_lm.sizes(template), rngs=nnx.Rngs(seed))
    nnx.update(model, ckpt.restore(path, nnx.state(model)))
    return model
  x = jnp.zeros((1, 2), jnp.int32)
  shapes = jax.eval_shape(models.build(template).init, jax.random.key(0), x)
  return ckpt.restore(path, shapes['params'])


def _config(name: str, exp: Any) -> lora.LoraConfig:
  r, base = exp.lora_rank, RUNS[name]
  return lora.LoraConfig(
    rank=r, alpha=2.0 * r, base=base, double_quant=base is not None
  )


def _finetune(name, exp, apply, params, rest, train, emit):
  """Trains `params` (the adapters): (params, history, losses, times)."""
  tx = loop.optimizer(exp)
  opt = tx.init(params)

  def step_fn(p, rest, o, x, y):
    value, g = jax.value_and_grad(
      lambda p: cross_entropy(apply(p, rest, x), y)
    )(p)
    upd, o = tx.update(g, o, p)
    return optax.apply_updates(p, upd), o, value

  # Plain jit (the uint4 codes' layout is fixed at the first call): the
  # compile time is the first step's.
  step_c = jax.jit(step_fn)
  history, losses, window, train_s, compile_s = [], [], [], 0.0, 0.0
  batches = loader.windows(train, exp.batch_size, exp.seq_len, exp.seed)
  tick = time.perf_counter()
  for i in range(1, exp.steps + 1):
    loop.check_stop()
    x, y = next(batches)
    params, opt, value = step_c(params, rest, opt, x, y)
    if i == 1:
      jax.block_until_ready(value)
      compile_s = time.perf_counter() - tick
      tick = time.perf_counter()
    window.append(value)
    if i % exp.log_every == 0 or i == exp.steps:
      losses.append(float(np.mean(jax.device_get(window))))
      window = []
      train_s += time.perf_counter() - tick
      rec = {'run': name, 'step': i, 'train_loss': losses[-1]}
      rec |= {'steps_per_s': i / train_s, 'time_s': train_s}
      history.append(rec)
      emit(rec)
      tick = time.perf_counter()
  return params, history, losses, compile_s, train_s


def _bpc(fn, eval_set) -> float:
  return evaluate_logits(fn, eval_set, 'bpc')['bpc']


def _stock(name, exp, base, train, eval_set, emit):
  """LoRA on the stock nnx LM `base`; (trained, numbers)."""
  x0 = jnp.zeros((1, exp.seq_len), jnp.int32)
  model = lora.attach(
    base, {STOCK_RULES: _config(name, exp)}, x0, seed=exp.seed
  )
  graphdef, params, rest = nnx.split(model, lora.Adapter, ...)

  def apply(p, r, x):
    return nnx.merge(graphdef, p, r)(x)

  def served(m):  # A model served alone: its own jitted forward.
    g, state = nnx.split(m)
    f = jax.jit(lambda s, x: nnx.merge(g, s)(x))
    return lambda x: f(state, x)

  frozen = _bpc(served(base), eval_set)
  params, *log = _finetune(name, exp, apply, params, rest, train, emit)
  model = nnx.merge(graphdef, params, rest)
  cal = _calibration(train, exp)
  merged = {
    'rtn': lora.merge(model, x0),
    'gptq': lora.merge(model, x0, batches=cal, **MERGE_SOLVER),
  }
  return _Tuned(
    params,
    rest,
    apply,
    served(model),
    frozen,
    {k: served(m) for k, m in merged.items()},
    lora.sizes(model, x0),
    log,
  )


def _pax(name, exp, template, float_params, train, eval_set, emit):
  """LoRA on the Pax LM (`template`, float `float_params`)."""
  x0 = jnp.zeros((1, exp.seq_len), jnp.int32)
  lt, lv = lora.attach(
    template,
    {PAX_RULES: _config(name, exp)},
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
  params, *log = _finetune(name, exp, apply, params, rest, train, emit)
  trained = dict(rest, params=lora.combine(params, frozen_params))
  cal = _calibration(train, exp)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', UserWarning)
    merged = {
      'rtn': lora.merge(lt, x0, variables=trained),
      'gptq': lora.merge(
        lt, x0, variables=trained, batches=cal, **MERGE_SOLVER
      ),
    }
  return _Tuned(
    params,
    rest,
    apply,
    served(lt, trained),
    frozen,
    {k: served(*m) for k, m in merged.items()},
    lora.sizes(lt, x0, variables=trained),
    log,
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
  log: list  # history, losses, compile_s, train_s


def run(
  name: str, exp: Any, base: Any, run_dir, *, template=None, on_record=None
):
  """Fine-tunes `base` with LoRA run `name`; (RunResult, serve dict).

  Args:
    name: a key of `RUNS`.
    exp: the Experiment.
    base: the float stock LM (stock runs) or the Pax LM's float params.
    run_dir: the run's folder (`lora.json` is written there).
    template: the Pax LM's float template (Pax runs).
    on_record: called with each metrics record.
  """
  emit = on_record or (lambda r: None)
  train, val = family_data(exp.finetune_family)
  eval_set = loader.eval_windows(
    val, exp.batch_size, exp.seq_len, exp.eval_batches
  )
  if is_stock(name):
    tuned = _stock(name, exp, base, train, eval_set, emit)
  else:
    tuned = _pax(name, exp, template, base, train, eval_set, emit)
  history, losses, compile_s, train_s = tuned.log
  forward = jax.jit(tuned.apply)

  def train_fn(p, x):
    return forward(p, tuned.rest, x)

  final = evaluate_logits(lambda x: train_fn(tuned.params, x), eval_set, 'bpc')
  emit({'run': name, 'step': exp.steps, **final})
  same = all(
    bool(np.array_equal(train_fn(tuned.params, x), tuned.serve(x)))
    for x, _ in eval_set
  )
  merged = {k: _bpc(f, eval_set) for k, f in tuned.merged.items()}
  sizes = tuned.sizes
  info = {
    'family': exp.finetune_family,
    'model': 'stock nnx LM' if is_stock(name) else 'Pax LM',
    'bpc': {
      'frozen_base': tuned.frozen_bpc,
      name: final['bpc'],
      **{f'{name}_merged_{k}': v for k, v in merged.items()},
    },
    'bytes': dataclasses.asdict(sizes) | {'ratio_to_full_ft': sizes.ratio},
    'step_s': train_s / max(exp.steps - 1, 1),
  }
  pathlib.Path(run_dir, 'lora.json').write_text(json.dumps(info, indent=1))
  cfg = _config(name, exp)
  rules = STOCK_RULES if is_stock(name) else PAX_RULES
  result = loop.RunResult(
    name=name,
    config=lora.nf4() if RUNS[name] else aqtr.presets.float(),
    injected=None,
    report=f'{name}: {cfg} on {rules} (family {exp.finetune_family})',
    params=tuned.params,
    step=exp.steps,
    train_loss=losses[-1],
    final=final,
    history=history,
    steps_per_s=(exp.steps - 1) / max(train_s, 1e-9),
    compile_s=compile_s,
    train_s=train_s,
    logits_fn=train_fn,
    param_opt_bytes=sizes.total,
  )
  serve = {  # Served as trained: frozen base + adapters + other params.
    'serving_bytes': sizes.base + sizes.adapters + sizes.other,
    'float_bytes': sizes.full // 3,
    'serve_equal': same,
    'merged_bpc': merged['rtn'],
    'merged_gptq_bpc': merged['gptq'],
    'frozen_bpc': tuned.frozen_bpc,
  }
  return result, serve


def check_fields(exp, lora_runs: tuple[str, ...]) -> None:
  """Raises one line for bad LoRA fields of Experiment `exp`."""
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
    want = base_run(n) if n in lora_runs else None
    if want and exp.init_from is None and want not in exp.runs[:i]:
      model = 'stock LM' if is_stock(n) else 'LM'
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
  nf4 = [n for n in names if RUNS[n] == 'nf4']
  if nf4 and exp.model is not None:
    d = stock_lm.sizes(exp.model)['d_model']
    if d % group:
      raise ValueError(
        f'runs: {nf4[0]!r} stores nf4 weights in groups of {group} inputs '
        f"but the LM's d_model is {d}; use a model with d_model a multiple "
        f'of {group} (e.g. config:default).'
      )
