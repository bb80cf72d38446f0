"""LoRA and QLoRA runs: pretrain the stock LM, fine-tune on a held-out domain.

The stock nnx Llama-style LM (`aqtr.train.stock_lm.StockLm`) is first
trained in float on the standard library minus one package family
(`FAMILY`, default 'email'); it is then fine-tuned on that family's train
files by:

  frozen      nothing (the pretrained model as it is)
  lora        LoRA r=8 on every projection of every block, float base
  qlora_nf4   QLoRA: the same adapters on an nf4 (g64) base with
              double-quantized scales
  full        full fine-tuning (every parameter, AdamW)

and each is scored in bits per character on the family's validation files
(split by file, `aqtr.data.stdlib.is_validation`). LoRA runs are also
served merged (`aqtr.lora.merge`: adapters folded in and re-quantized by
round to nearest, and QLoRA's also solved by `MERGE_SOLVER`: GPTQ on
`merge_batches` calibration batches of the family's train files, on the
base's own grid). bpc is over the first `eval_windows` windows of `seq`
bytes (default: the whole validation split).
Step times are measured in one process; bytes by `aqtr.lora.sizes`.

Run: `python -m aqtr.train.lora_runs --out=DIR` (writes DIR/lora.json and
DIR/lora.md), or `run(Settings(...))`.

Example:
  >>> s = Settings(pretrain_steps=2, finetune_steps=2, d_model=16)
  >>> s.family
  'email'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import aqtr.lora as lora
import aqtr.ptq as ptq
from aqtr.data import stdlib
from aqtr.train import loop
from aqtr.train.lora_job import family_data, read
from aqtr.train.stock_lm import StockLm

__all__ = [
  'RUNS',
  'Settings',
  'corpora',
  'run',
  'table',
]

RUNS = ('frozen', 'lora', 'qlora_nf4', 'full')
# How QLoRA's merged weights are solved (`aqtr.lora.merge`'s arguments):
# GPTQ with act-order on the base's own nf4 grid (measured best).
MERGE_SOLVER = {'method': ptq.Gptq(act_order=True), 'grid': 'base'}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
  """Sizes of the LoRA experiment (defaults: a few minutes on 2 cores)."""

  family: str = 'email'
  pretrain_bytes: int = 2_000_000
  d_model: int = 128
  num_layers: int = 2
  num_heads: int = 4
  seq: int = 128
  batch: int = 16
  pretrain_steps: int = 500
  finetune_steps: int = 250
  pretrain_lr: float = 3e-3
  lora_lr: float = 3e-3
  full_lr: float = 1e-3
  rank: int = 8
  alpha: float = 16.0
  eval_windows: int = 1024
  merge_batches: int = 8
  seed: int = 0

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if f.name not in ('family', 'seed') and not (
        isinstance(v, int | float) and v > 0
      ):
        raise ValueError(f'Settings.{f.name} must be > 0, got {v!r}.')


def corpora(s: Settings) -> dict[str, np.ndarray]:
  """'pretrain' (all but the family), 'train' / 'val' (the family)."""
  rest = [n for n in stdlib.files() if not n.startswith(s.family + '/')]
  train, val = family_data(s.family)
  return {'pretrain': read(rest, s.pretrain_bytes), 'train': train, 'val': val}


def _batches(data: np.ndarray, s: Settings, seed: int):
  rng = np.random.default_rng(seed)
  while True:
    i = rng.integers(0, len(data) - s.seq - 1, s.batch)
    w = np.stack([data[j : j + s.seq + 1] for j in i]).astype(np.int32)
    yield jnp.asarray(w[:, :-1]), jnp.asarray(w[:, 1:])


def _loss(model, x, y):
  logits = model(x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def bpc(model, data: np.ndarray, s: Settings) -> float:
  """Bits per character of `model` on the first windows of `data`."""
  n = min(s.eval_windows, (len(data) - 1) // s.seq)
  w = data[: n * s.seq + 1].astype(np.int32)
  x = jnp.asarray(w[:-1].reshape(n, s.seq))
  y = jnp.asarray(w[1:].reshape(n, s.seq))
  graphdef, state = nnx.split(model)
  f = jax.jit(lambda st, x, y: _loss(nnx.merge(graphdef, st), x, y))
  total = sum(
    float(f(state, x[i : i + s.batch], y[i : i + s.batch]))
    * len(x[i : i + s.batch])
    for i in range(0, n, s.batch)
  )
  return total / n / math.log(2)


def train(model, data, s: Settings, steps: int, lr: float, wrt, seed: int):
  """Trains `wrt` of `model` with AdamW (`loop.fit`); (model, s/step)."""
  sched = optax.warmup_cosine_decay_schedule(0.0, lr, steps // 10 + 1, steps)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched))
  graphdef, params, rest = nnx.split(model, wrt, ...)

  def apply(p, state, r, x, step):
    del step
    return nnx.merge(graphdef, p, r)(x), state

  fitted = loop.fit(
    'lora_runs',
    loop.Trainee(params=params, apply=apply, frozen=rest),
    tx,
    _batches(data, s, seed),
    loop.Schedule(steps=steps, log_every=steps),
    show_progress=False,
    loss=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(
      logits, y
    ).mean(),
  )
  if fitted.diverged:
    raise FloatingPointError(f'lora_runs: {fitted.diverged}')
  return nnx.merge(graphdef, fitted.params, rest), 1 / fitted.steps_per_s


def run(s: Settings) -> dict[str, Any]:
  """The experiment's numbers (see the module docstring)."""
  data = corpora(s)
  model = StockLm(
    stdlib.VOCAB_SIZE,
    s.d_model,
    s.num_layers,
    s.num_heads,
    rngs=nnx.Rngs(s.seed),
  )
  t = time.perf_counter()
  model, _ = train(
    model, data['pretrain'], s, s.pretrain_steps, s.pretrain_lr, nnx.Param, 1
  )
  out: dict[str, Any] = {
    'settings': dataclasses.asdict(s),
    'pretrain_s': time.perf_counter() - t,
    'bytes': {k: int(len(v)) for k, v in data.items()},
    'bpc': {'frozen': bpc(model, data['val'], s)},
    'pretrain_bpc': bpc(model, data['pretrain'][-200_000:], s),
    'step_s': {},
    'sizes': {},
    'merged_bpc': {},
    'merged_gptq_bpc': {},
    'merged_int8_bpc': {},
  }
  print(f'pretrained: {out["bpc"]["frozen"]:.4f} bpc', flush=True)
  sample = jnp.zeros((1, s.seq), jnp.int32)
  for name, base in (('lora', None), ('qlora_nf4', 'nf4')):
    cfg = lora.LoraConfig(
      rank=s.rank, alpha=s.alpha, base=base, double_quant=base is not None
    )
    m = lora.attach(model, {'.*blocks.*': cfg}, sample, seed=s.seed)
    m, per = train(
      m, data['train'], s, s.finetune_steps, s.lora_lr, lora.Adapter, 2
    )
    out['bpc'][name] = bpc(m, data['val'], s)
    out['step_s'][name] = per
    out['sizes'][name] = dataclasses.asdict(lora.sizes(m, sample))
    out['merged_bpc'][name] = bpc(lora.merge(m, sample), data['val'], s)
    if base is not None:
      it = _batches(data['train'], s, 3)
      cal = [next(it)[0] for _ in range(s.merge_batches)]
      solved = lora.merge(m, sample, batches=cal, **MERGE_SOLVER)
      out['merged_gptq_bpc'][name] = bpc(solved, data['val'], s)
    int8 = lora.merge(m, sample, requantize='int8_weight_only')
    out['merged_int8_bpc'][name] = bpc(int8, data['val'], s)
    print(
      f'{name}: {out["bpc"][name]:.4f} bpc, {per * 1e3:.0f} ms/step', flush=True
    )
  nodq = lora.attach(
    model,
    {'.*blocks.*': lora.LoraConfig(rank=s.rank, alpha=s.alpha, base='nf4')},
    sample,
  )
  out['sizes']['qlora_nf4_no_double_quant'] = dataclasses.asdict(
    lora.sizes(nodq, sample)
  )
  full, per = train(
    nnx.clone(model),
    data['train'],
    s,
    s.finetune_steps,
    s.full_lr,
    nnx.Param,
    2,
  )
  out['bpc']['full'] = bpc(full, data['val'], s)
  out['step_s']['full'] = per
  return out


def table(r: dict[str, Any]) -> str:
  """The results as a markdown table."""
  lines = [
    f'Fine-tuning domain: stdlib `{r["settings"]["family"]}/` (validation '
    'files); bpc: bits per character.',
    '',
    '| run | bpc | merged bpc | merged (gptq) bpc | merged int8 bpc | '
    'step ms | trainable B | optimizer B | frozen base B | bits/base weight '
    '| bytes / full FT |',
    '|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  for name in RUNS:
    sz = r['sizes'].get(name)
    step = r['step_s'].get(name)
    merged = r['merged_bpc'].get(name)
    solved = r.get('merged_gptq_bpc', {}).get(name)
    m8 = r['merged_int8_bpc'].get(name)
    row = [
      name,
      f'{r["bpc"][name]:.4f}',
      f'{merged:.4f}' if merged is not None else '',
      f'{solved:.4f}' if solved is not None else '',
      f'{m8:.4f}' if m8 is not None else '',
      f'{step * 1e3:.1f}' if step is not None else '',
    ]
    if sz is not None:
      total = sz['adapters'] + sz['optimizer'] + sz['base'] + sz['other']
      row += [
        str(sz['adapters']),
        str(sz['optimizer']),
        str(sz['base']),
        f'{32 * sz["base"] / sz["base_float"]:.3f}',
        f'{total / sz["full"]:.3f}',
      ]
    else:
      row += [''] * 5
    lines.append('| ' + ' | '.join(row) + ' |')
  nd = r['sizes']['qlora_nf4_no_double_quant']
  lines.append(
    f'\nQLoRA base without double quantization: {nd["base"]} B '
    f'({32 * nd["base"] / nd["base_float"]:.3f} bits/weight).'
  )
  return '\n'.join(lines)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--out', default='lora_out')
  p.add_argument('--pretrain_steps', type=int, default=500)
  p.add_argument('--finetune_steps', type=int, default=250)
  a = p.parse_args(argv)
  s = Settings(pretrain_steps=a.pretrain_steps, finetune_steps=a.finetune_steps)
  r = run(s)
  out = pathlib.Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / 'lora.json').write_text(json.dumps(r, indent=1))
  (out / 'lora.md').write_text(table(r) + '\n')
  print(table(r))


if __name__ == '__main__':
  main()
