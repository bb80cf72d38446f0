"""One dot's fwd+VJP and an LM train step on an accelerator, with HLO census.

The tables of issue 41, in one command, printed row by row as they are
measured (and written to `--out`):

Dots: for each shape (M x K x N), each row is one jitted program of bf16
inputs: `jax.vjp` of one dot, then its VJP (output and both gradients).
Rows (benchmarks/gpu_rows.py): `bf16` (`lax.dot_general`); `limit int8`
and `limit fp8`, the three bare low-precision dots of a fwd+VJP on
operands already quantized and laid out (every operand contracting its
minor axis; int8 -> s32; e4m3 fwd, e5m2 gradient -> bf16), no quantizing
or scaling: what any implementation must pay; aqtr `int8()`, `int8_fwd()`,
int8 with stochastic rounding, `fp8()`, `fp8_delayed()`, `mxfp8()`,
NVFP4 weight-only; AQT (aqtp) int8 and fp8 (its fp8 recipe quantizes the
forward only); Qwix int8 and fp8 (e4m3 operands, e5m2 gradients). A peer
row says `skipped` with the reason when its package is missing.

Columns: `ms` minimum of `--calls` timed calls after one warm-up call;
`TFLOP/s` 6 M K N / time; `x bf16` bf16's ms / the row's ms, same shape,
same run (higher is faster); `x limit` the same against the row's limit
(int8 rows: `limit int8`, fp8 rows: `limit fp8`); `lower s` and `compile
s` the wall time of `jax.jit(f).lower(...)` and of `.compile()`; then the
census of the optimized HLO (benchmarks/hlo_census.py): every GEMM
(custom-call target, Triton / YNNPACK GEMM fusion or bare dot) with the
element types it multiplies and which operands contract their minor axis
(`K minor: both` is what cuBLASLt's int8 / fp8 kernels want), the number
of `while` loops, and `big kernels`: other kernels that read or write an
operand-sized tensor (at least the smallest of M K, K N, M N elements),
and how many of them touch more than one.

Train step (benchmarks/gpu_lm.py): a 2-layer transformer LM (d_model
2048, MLP 8192, vocab 32768, 8 x 2048 tokens, AdamW), every weight matmul
through the row's dot: `bf16`, aqtr `int8`, aqtr `fp8`. Columns: ms per
step (minimum of `--calls` steps), steps/s, x bf16, lower s, compile s,
the compiled step's temporary bytes, and the losses of the first
`--steps` steps on one batch (the same initial parameters in every row).

Order (what issue 41's targets rest on first): bf16, both limits, aqtr
int8 and fp8 and Qwix fp8 at the first two `--shapes`; the train step;
the other rows at those shapes; every row at the further shapes
(`--list` prints the plan).

Each row runs in a worker process (benchmarks/gpu_worker.py) under a
budget (`--row-budget`, `--train-budget`, and `--budget` for the whole
run): a row past its budget is killed, reported with the stage it was in,
and the next row starts in a fresh worker. A row that fails prints its
one-line error and the run goes on.

Run:
  python benchmarks/gpu.py [--shapes 8192 4096 lm] [--rows ...]
    [--train-rows bf16 int8 fp8] [--calls 10] [--out DIR] [--budget S]
  python benchmarks/gpu.py --smoke --out /tmp/gpu   # tiny shapes, on CPU
On a lent GPU machine: benchmarks/gpu_run.sh (installs carried wheels).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import pathlib
import re
import sys
import time

import gpu_lm
import gpu_rows
import gpu_tables
import host
import jax
from gpu_tables import Worker


def parse_args(argv=None) -> argparse.Namespace:
  """The flags, checked; `dims` holds the (M, K, N) of each shape."""
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--smoke', action='store_true', help='tiny shapes (CPU)')
  ap.add_argument('--shapes', nargs='+', help='8192, 4096, lm or MxKxN')
  ap.add_argument('--rows', nargs='+', default=list(gpu_rows.ROWS))
  ap.add_argument('--train-rows', nargs='*', default=list(gpu_lm.ROWS))
  ap.add_argument('--calls', type=int, help='timed calls per row (10)')
  ap.add_argument('--steps', type=int, default=5, help='loss-curve steps')
  ap.add_argument('--out', help='directory for gpu.md, gpu.json, hlo/')
  ap.add_argument('--budget', type=float, default=0, help='run s (0: none)')
  ap.add_argument('--row-budget', type=float, default=150)
  ap.add_argument('--train-budget', type=float, default=240)
  ap.add_argument('--list', action='store_true', help='print the plan, exit')
  args = ap.parse_args(argv)
  if args.shapes is None:
    args.shapes = ['smoke'] if args.smoke else ['8192', '4096', 'lm']
  if args.calls is None:
    args.calls = 3 if args.smoke else 10
  for row in args.rows:
    if row not in gpu_rows.ROWS:
      ap.error(f'--rows: unknown row {row!r}; rows are {gpu_rows.ROWS}.')
  for row in args.train_rows:
    if row != 'bf16' and not re.fullmatch(r'[a-z0-9_]+', row):
      ap.error(f'--train-rows: {row!r} is not bf16 or a preset name.')
  try:
    args.dims = [gpu_rows.parse_shape(s) for s in args.shapes]
  except ValueError as e:
    ap.error(str(e))
  return args


def plan(args) -> list[dict]:
  """The requests in run order.

  The main rows (gpu_rows.MAIN) at the first two shapes, the train step,
  the other rows at those shapes, then every row at the further shapes.
  """
  main = [r for r in gpu_rows.MAIN if r in args.rows]
  rest = [r for r in gpu_rows.REST if r in args.rows]
  size = gpu_lm.SMOKE if args.smoke else gpu_lm.FULL

  def dots(rows, shapes):
    return [
      dict(kind='dot', row=r, shape=list(s), calls=args.calls, hlo='')
      for s in shapes
      for r in rows
    ]

  train = [
    dict(
      kind='train',
      row=r,
      size=dataclasses.asdict(size),
      calls=args.calls,
      steps=args.steps,
    )
    for r in args.train_rows
  ]
  first, further = args.dims[:2], args.dims[2:]
  return (
    dots(main, first) + train + dots(rest, first) + dots(main + rest, further)
  )


def main(argv=None) -> None:
  """Runs the plan row by row, printing and writing as it goes."""
  args = parse_args(argv)
  if args.list:
    for req in plan(args):
      print(req['kind'], req['row'], req.get('shape', req.get('size')))
    return
  # Only the worker touches the accelerator (this process would otherwise
  # take its memory if anything here made an array).
  jax.config.update('jax_platforms', 'cpu')
  out = pathlib.Path(args.out) if args.out else None
  if out:
    (out / 'hlo').mkdir(parents=True, exist_ok=True)
  t_start = time.monotonic()
  worker = Worker()
  meta = {
    'command': 'python benchmarks/gpu.py ' + ' '.join(sys.argv[1:]),
    'date': f'{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC',
    'host': host.cpu_model(),
    **worker.hello,
    'lm': str(gpu_lm.SMOKE if args.smoke else gpu_lm.FULL),
    'calls': args.calls,
  }
  tables = gpu_tables.Tables(meta)
  for line in tables.header():
    print(line, flush=True)
  for req in plan(args):
    left = args.budget - (time.monotonic() - t_start) if args.budget else 1e9
    budget = min(
      args.row_budget if req['kind'] == 'dot' else args.train_budget, left
    )
    if left < 10:
      res = {'skip': 'the run budget (--budget) is spent'}
    else:
      if out and req['kind'] == 'dot':
        shape = 'x'.join(map(str, req['shape']))
        name = re.sub(r'\W+', '_', f'{shape} {req["row"]}')
        req['hlo'] = str(out / 'hlo' / f'{name}.hlo.gz')
      if not worker.alive:
        worker = Worker(hello_timeout=min(600, max(left, 30)))
      res = worker.ask(req, budget)
    for line in tables.add(req, res):
      print(line, flush=True)
    if out:
      tables.write(out)
  worker.close()
  print('\n## All tables')
  print('\n'.join(tables.markdown(census=False)[len(tables.header()) :]))
  where = f'; tables and census in {out}/gpu.md' if out else ''
  print(f'\ntotal wall time {time.monotonic() - t_start:.0f} s{where}')


if __name__ == '__main__':
  main()
