"""The process of benchmarks/gpu.py that compiles and times the rows.

benchmarks/gpu.py starts it (`python benchmarks/gpu_worker.py`) and
sends it one JSON request per line on stdin; it answers with lines that
start with `@@` on stdout: `@@hello {...}` once (jax version, devices),
`@@stage <name>` as a row moves on (lower, compile, warm-up, timed calls,
census), and `@@result {...}` per request. The parent kills it when a row
runs past its budget and starts another for the next row; only this
process touches the accelerator.

Requests:
  {"kind": "dot", "row": "aqtr int8", "shape": [M, K, N], "calls": 10,
   "hlo": "path or empty"}
  {"kind": "train", "row": "int8", "size": {LmSize fields}, "calls": 10,
   "steps": 5}

Example (what gpu.py sends; here without the parent):
  >>> import json, subprocess, sys
  >>> p = subprocess.run([sys.executable, 'benchmarks/gpu_worker.py'],
  ...   input=json.dumps(dict(kind='dot', row='bf16', shape=[8, 32, 16],
  ...   calls=2, hlo='')), capture_output=True, text=True)
  >>> [l.split()[0] for l in p.stdout.splitlines() if l.startswith('@@')][-1]
  '@@result'
"""

from __future__ import annotations

import gzip
import json
import sys
import time

import gpu_lm
import gpu_rows
import hlo_census
import jax


def _say(tag: str, payload) -> None:
  text = payload if isinstance(payload, str) else json.dumps(payload)
  print(f'@@{tag} {text}', flush=True)


def _one_line(e: BaseException) -> str:
  first = (str(e).strip().splitlines() or [''])[0]
  return f'{type(e).__name__}: {first}'[:300]


def _compile(f, args) -> tuple:
  _say('stage', 'lower')
  t0 = time.perf_counter()
  lowered = f.lower(*args)
  t1 = time.perf_counter()
  _say('stage', 'compile')
  compiled = lowered.compile()
  t2 = time.perf_counter()
  return compiled, t1 - t0, t2 - t1


def _temp_bytes(compiled) -> int | None:
  try:
    return int(compiled.memory_analysis().temp_size_in_bytes)
  except Exception:  # Not every backend reports it.
    return None


_DATA: dict = {}


def dot_row(req: dict) -> dict:
  """Compiles, times and takes the census of one dot row."""
  _say('stage', 'setup')
  shape = tuple(req['shape'])
  if shape not in _DATA:
    _DATA.clear()  # One shape's operands at a time.
    _DATA[shape] = gpu_rows.data(shape)
  try:
    f, args = gpu_rows.make(req['row'], _DATA[shape])
  except gpu_rows.Skip as e:
    return {'skip': str(e)}
  compiled, lower_s, compile_s = _compile(jax.jit(f), args)
  _say('stage', 'warm-up')
  jax.block_until_ready(compiled(*args))
  _say('stage', 'timed calls')
  times = []
  for _ in range(req['calls']):
    t = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t)
  _say('stage', 'census')
  m, k, n = shape
  text = compiled.as_text()
  census = hlo_census.census(text, min(m * k, k * n, m * n))
  if req.get('hlo'):
    with gzip.open(req['hlo'], 'wt') as fh:
      fh.write(text)
  return {
    'ms': min(times) * 1e3,
    'lower_s': lower_s,
    'compile_s': compile_s,
    'temp_bytes': _temp_bytes(compiled),
    'gemms': census.gemm_summary(),
    'whiles': census.whiles,
    'big': census.big_summary(),
    'census': census.as_dict(),
  }


def train_row(req: dict) -> dict:
  """Compiles one LM step, runs `steps` steps (losses), times `calls`."""
  _say('stage', 'setup')
  size = gpu_lm.LmSize(**req['size'])
  step, state, batch = gpu_lm.setup(req['row'], size)
  compiled, lower_s, compile_s = _compile(step, (*state, *batch))
  losses = []
  _say('stage', f'{req["steps"]} steps')
  for _ in range(req['steps']):
    state, loss = compiled(*state, *batch)
    losses.append(float(loss))
  _say('stage', 'timed steps')
  times = []
  for _ in range(req['calls']):
    t = time.perf_counter()
    state, loss = compiled(*state, *batch)
    jax.block_until_ready(loss)
    times.append(time.perf_counter() - t)
  return {
    'ms': min(times) * 1e3,
    'lower_s': lower_s,
    'compile_s': compile_s,
    'temp_bytes': _temp_bytes(compiled),
    'losses': losses,
  }


def _platform_version(dev) -> str:
  try:
    return str(dev.client.platform_version)
  except AttributeError:
    return ''


def main() -> None:
  dev = jax.devices()[0]
  _say(
    'hello',
    {
      'jax': jax.__version__,
      'backend': jax.default_backend(),
      'device': f'{dev.device_kind} x{jax.device_count()}',
      'platform_version': _platform_version(dev),
    },
  )
  for line in sys.stdin:
    if not line.strip():
      continue
    req = json.loads(line)
    run = dot_row if req['kind'] == 'dot' else train_row
    try:
      out = run(req)
    except Exception as e:  # The row's one-line error, and on to the next.
      out = {'error': _one_line(e)}
    _say('result', out)


if __name__ == '__main__':
  main()
