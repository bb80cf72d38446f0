"""The main job's LoRA runs: 'lora' and 'qlora_nf4' (`aqtr.lora`).

Both fine-tune a float stock nnx LM (`aqtr.train.stock_lm.StockLm`): the
'stock_float' run of the same job (which then pretrains without the
fine-tuning family: `tasks.make` leaves `Experiment.finetune_family` out
of the corpus), or the checkpoint `Experiment.init_from` names (a
'stock_float' run folder's `float_params`, written when a job has LoRA
runs). They fine-tune on the family's train files (`family_split`),
the job's steps and optimizer, adapters r =
`Experiment.lora_rank` (alpha 2r) on every block projection:

  lora        float base (LoRA, arXiv 2106.09685)
  qlora_nf4   nf4 g64 base, double-quantized scales (QLoRA, arXiv
              2305.14314)

The summary row's bpc is on the family's validation files; the run's
`lora.json` adds the frozen base's and the merged model's bpc there, and
the bytes of `aqtr.lora.sizes`.

Example:
  >>> sorted(RUNS)
  ['lora', 'qlora_nf4']
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import aqtr
import aqtr.flax.checkpoint as ckpt
from aqtr import lora
from aqtr.data import loader, stdlib
from aqtr.train import loop, stock_lm
from aqtr.train.tasks import cross_entropy, evaluate_logits

__all__ = [
  'check_fields',
  'BASE_DIR',
  'RUNS',
  'family_data',
  'family_split',
  'load_base',
  'read',
  'run',
  'save_base',
]

RUNS = {'lora': None, 'qlora_nf4': 'nf4'}
BASE_DIR = 'float_params'  # In the 'stock_float' run's folder.


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


def save_base(model: nnx.Module, run_dir: pathlib.Path) -> pathlib.Path:
  """Saves the float stock LM for `init_from` (orbax)."""
  path = pathlib.Path(run_dir).absolute() / BASE_DIR
  ckpt.save(path, nnx.state(model))
  return path


def load_base(path: str, template: Any, seed: int) -> nnx.Module:
  """The float stock LM saved by `save_base` at `path`."""
  model = stock_lm.StockLm(**stock_lm.sizes(template), rngs=nnx.Rngs(seed))
  nnx.update(model, ckpt.restore(path, nnx.state(model)))
  return model


def _eval(model, eval_set):
  graphdef, state = nnx.split(model)
  f = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
  return evaluate_logits(lambda x: f(state, x), eval_set, 'bpc'), f, state


def run(name: str, exp: Any, base: nnx.Module, run_dir, *, on_record=None):
  """Fine-tunes `base` with the LoRA run `name`; (RunResult, serve dict)."""
  emit = on_record or (lambda r: None)
  train, val = family_data(exp.finetune_family)
  b, t = exp.batch_size, exp.seq_len
  eval_set = loader.eval_windows(val, b, t, exp.eval_batches)
  r = exp.lora_rank
  cfg = lora.LoraConfig(
    rank=r, alpha=2.0 * r, base=RUNS[name], double_quant=RUNS[name] is not None
  )
  x0 = jnp.zeros((1, t), jnp.int32)
  model = lora.attach(base, {'.*blocks.*': cfg}, x0, seed=exp.seed)
  graphdef, params, rest = nnx.split(model, lora.Adapter, ...)
  tx = loop.optimizer(exp)
  opt = tx.init(params)

  def step_fn(p, rest, o, x, y):
    def loss(p):
      return cross_entropy(nnx.merge(graphdef, p, rest)(x), y)

    value, g = jax.value_and_grad(loss)(p)
    upd, o = tx.update(g, o, p)
    return optax.apply_updates(p, upd), o, value

  # Plain jit (the uint4 codes' layout is fixed at the first call): the
  # compile time is the first step's.
  step_c = jax.jit(step_fn)
  frozen, _, _ = _eval(base, eval_set)
  history, losses, window, train_s = [], [], [], 0.0
  batches = loader.windows(train, b, t, exp.seed)
  tick = time.perf_counter()
  compile_s = 0.0
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
  model = nnx.merge(graphdef, params, rest)
  final, serve_fn, state = _eval(model, eval_set)
  emit({'run': name, 'step': exp.steps, **final})
  forward = jax.jit(lambda p, r, x: nnx.merge(graphdef, p, r)(x))

  def train_fn(p, x):
    return forward(p, rest, x)

  same = all(
    bool(np.array_equal(train_fn(params, x), serve_fn(state, x)))
    for x, _ in eval_set
  )
  merged = lora.merge(model, x0)
  merged_rec, _, _ = _eval(merged, eval_set)
  sizes = lora.sizes(model, x0)
  info = {
    'family': exp.finetune_family,
    'bpc': {
      'frozen_base': frozen['bpc'],
      name: final['bpc'],
      f'{name}_merged': merged_rec['bpc'],
    },
    'bytes': dataclasses.asdict(sizes) | {'ratio_to_full_ft': sizes.ratio},
  }
  pathlib.Path(run_dir, 'lora.json').write_text(json.dumps(info, indent=1))
  result = loop.RunResult(
    name=name,
    config=lora.nf4() if RUNS[name] else aqtr.presets.float(),
    injected=model,
    report=f'{name}: {cfg} on .*blocks.* (family {exp.finetune_family})',
    params=params,
    step=exp.steps,
    train_loss=losses[-1],
    final=final,
    history=history,
    steps_per_s=exp.steps / max(train_s, 1e-9),
    compile_s=compile_s,
    train_s=train_s,
    logits_fn=train_fn,
    param_opt_bytes=sizes.total,
  )
  serve = {  # Served as trained: frozen base + adapters + other params.
    'serving_bytes': sizes.base + sizes.adapters + sizes.other,
    'float_bytes': sizes.full // 3,
    'serve_equal': same,
    'merged_bpc': merged_rec['bpc'],
    'frozen_bpc': frozen['bpc'],
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
  first = exp.runs.index(names[0])
  if exp.init_from is None and 'stock_float' not in exp.runs[:first]:
    raise ValueError(
      f'runs: {names[0]!r} fine-tunes a float stock LM: put '
      "'stock_float' before it in runs, or set init_from=<a job's "
      'stock_float/float_params>.'
    )
  if not isinstance(exp.finetune_family, str) or not exp.finetune_family:
    raise ValueError(
      'finetune_family must name a stdlib package (e.g. email), got '
      f'{exp.finetune_family!r}.'
    )
  group = lora.nf4().fwd.rhs.tiling.tile_size
  if 'qlora_nf4' in names and exp.model is not None:
    d = stock_lm.sizes(exp.model)['d_model']
    if d % group:
      raise ValueError(
        f"runs: 'qlora_nf4' stores nf4 weights in groups of {group} inputs "
        f"but the LM's d_model is {d}; use a model with d_model a multiple "
        f'of {group} (e.g. config:default).'
      )
