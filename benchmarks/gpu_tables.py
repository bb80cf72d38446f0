"""benchmarks/gpu.py's worker process handle and its tables.

`Worker` runs benchmarks/gpu_worker.py and asks it for one row at a time
under a time budget; `Tables` turns the answers into the printed rows and
the files under `--out` (gpu.md, gpu.json).

Example:
  >>> t = Tables({'device': 'cpu'})
  >>> req = dict(kind='dot', row='bf16', shape=[8, 8, 8])
  >>> t.add(req, {'ms': 1.0, 'lower_s': 0.1, 'compile_s': 0.2,
  ...   'gemms': 'dot: bf16 x bf16 -> bf16', 'whiles': 0, 'big': '0 (0)'}
  ...   )[-1].split('|')[1:4]
  [' bf16 ', ' 1.000 ', ' 3.07e-06 ']
"""

from __future__ import annotations

import json
import pathlib
import queue
import subprocess
import sys
import threading
import time

import gpu_rows

WORKER = pathlib.Path(__file__).with_name('gpu_worker.py')


class Worker:
  """A gpu_worker.py process: `ask` sends a request and waits for it."""

  def __init__(self, hello_timeout: float = 600):
    self.proc = subprocess.Popen(
      [sys.executable, str(WORKER)],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      text=True,
      bufsize=1,
    )
    self.lines: queue.Queue = queue.Queue()
    threading.Thread(target=self._read, daemon=True).start()
    self.alive = True
    hello = self._next('hello', hello_timeout)
    self.hello = hello if 'error' not in hello else {'device': '?', **hello}

  def _read(self) -> None:
    for line in self.proc.stdout:
      self.lines.put(line.rstrip('\n'))
    self.lines.put(None)

  def _next(self, tag: str, timeout: float, stage: list | None = None):
    """The payload of the next `@@tag` line, or an error dict."""
    deadline = time.monotonic() + timeout
    stage = stage if stage is not None else ['start', time.monotonic()]
    while True:
      try:
        line = self.lines.get(timeout=max(deadline - time.monotonic(), 0))
      except queue.Empty:
        self.kill()
        spent = time.monotonic() - stage[1]
        return {
          'error': f'timed out (budget {timeout:.0f} s) in {stage[0]} '
          f'after {spent:.0f} s there'
        }
      if line is None:
        self.alive = False
        rc = self.proc.wait()
        return {'error': f'worker exited (rc {rc}) in {stage[0]}'}
      if not line.startswith('@@'):
        print(f'  worker: {line}', file=sys.stderr, flush=True)
        continue
      got, _, payload = line[2:].partition(' ')
      if got == 'stage':
        stage[:] = [payload, time.monotonic()]
      elif got == tag:
        return json.loads(payload)

  def ask(self, req: dict, budget: float) -> dict:
    """Runs one request; its result, or {'error': ...} past `budget` s."""
    what = req['row'] if req['kind'] == 'train' else req['shape']
    print(f'  {req["kind"]} {req["row"]} {what}', file=sys.stderr, flush=True)
    try:
      self.proc.stdin.write(json.dumps(req) + '\n')
      self.proc.stdin.flush()
    except BrokenPipeError:
      self.alive = False
      return {'error': 'worker gone before the request'}
    return self._next('result', budget, ['setup', time.monotonic()])

  def kill(self) -> None:
    """Ends this worker process (by its own handle) and waits for it."""
    self.alive = False
    self.proc.kill()
    self.proc.wait()

  def close(self) -> None:
    """Closes stdin (the worker then exits) and waits for it."""
    if self.alive:
      self.proc.stdin.close()
      try:
        self.proc.wait(timeout=60)
      except subprocess.TimeoutExpired:
        self.kill()
    self.alive = False


DOT_COLS = (
  'row',
  'ms',
  'TFLOP/s',
  'x bf16',
  'x limit',
  'lower s',
  'compile s',
  'GEMMs (HLO census)',
  'while',
  'big kernels',
)
TRAIN_COLS = (
  'step',
  'ms/step',
  'steps/s',
  'x bf16',
  'lower s',
  'compile s',
  'temp GB',
  'losses',
)


def _row(cells) -> str:
  return '| ' + ' | '.join(str(c) for c in cells) + ' |'


def _flops(tflops: float) -> str:
  return f'{tflops:.1f}' if tflops >= 10 else f'{tflops:.3g}'


def _title(req: dict, meta: dict) -> str:
  if req['kind'] == 'train':
    return f'Train step: {meta.get("lm", "")}'
  m, k, n = req['shape']
  return f'fwd+VJP of one dot, {m} x {k} x {n} (M x K x N), bf16 inputs'


class Tables:
  """The rows measured so far, as printed lines and as files."""

  def __init__(self, meta: dict):
    self.meta = meta
    self.rows: list[tuple[dict, dict]] = []
    self._section = None

  def header(self) -> list[str]:
    m = self.meta
    return [
      f'command: {m.get("command", "")}',
      f'date: {m.get("date", "")}; host: {m.get("host", "")}',
      f'device: {m.get("device", "?")} ({m.get("backend", "?")}, jax '
      f'{m.get("jax", "?")}, {m.get("platform_version", "")})',
      f'ms: minimum of {m.get("calls", "?")} timed calls after a warm-up',
    ] + ([f'worker start failed: {m["error"]}'] if 'error' in m else [])

  def _ms(self, kind: str, shape, row: str) -> float | None:
    for req, res in self.rows:
      same = req['kind'] == kind and req.get('shape') == shape
      if same and req['row'] == row and 'ms' in res:
        return res['ms']
    return None

  def line(self, req: dict, res: dict) -> str:
    """One table row of a result (or its skip / error)."""
    train = req['kind'] == 'train'
    cols = TRAIN_COLS if train else DOT_COLS
    if 'ms' not in res:
      note = res.get('error') or f'skipped: {res.get("skip", "?")}'
      note = note.replace('|', '/')
      return _row([req['row'], note] + ['-'] * (len(cols) - 2))
    ms = res['ms']
    base = self._ms(req['kind'], req.get('shape'), 'bf16')
    x_bf16 = f'{base / ms:.2f}' if base else '-'
    temp = res.get('temp_bytes')
    temp = f'{temp / 1e9:.1f}' if temp is not None else '-'
    if train:
      losses = ', '.join(f'{v:.2f}' for v in res['losses'])
      return _row(
        [
          req['row'],
          f'{ms:.2f}',
          f'{1e3 / ms:.2f}',
          x_bf16,
          f'{res["lower_s"]:.1f}',
          f'{res["compile_s"]:.1f}',
          temp,
          losses,
        ]
      )
    m, k, n = req['shape']
    lim = gpu_rows.limit_of(req['row'])
    lim_ms = self._ms('dot', req['shape'], lim) if lim else None
    return _row(
      [
        req['row'],
        f'{ms:.3f}' if ms < 10 else f'{ms:.2f}',
        _flops(6 * m * k * n / (ms * 1e-3) / 1e12),
        x_bf16,
        f'{lim_ms / ms:.2f}' if lim_ms else '-',
        f'{res["lower_s"]:.1f}',
        f'{res["compile_s"]:.1f}',
        res['gemms'] or 'none',
        res['whiles'],
        res['big'],
      ]
    )

  def add(self, req: dict, res: dict) -> list[str]:
    """Records a result; the lines to print (a section header if new)."""
    self.rows.append((req, res))
    out = []
    title = _title(req, self.meta)
    if title != self._section:
      self._section = title
      if any(_title(q, self.meta) == title for q, _ in self.rows[:-1]):
        title += ' (continued)'

      cols = TRAIN_COLS if req['kind'] == 'train' else DOT_COLS
      out += ['', f'### {title}', '', _row(cols), _row(['---'] * len(cols))]
    return out + [self.line(req, res)]

  def markdown(self, census: bool = True) -> list[str]:
    """Every table, rows grouped by section in first-seen order.

    Args:
      census: add each row's GEMMs and big kernels after the tables.
    """
    sections: dict[str, list] = {}
    for req, res in self.rows:
      sections.setdefault(_title(req, self.meta), []).append((req, res))
    out = [*self.header()]
    for title, rows in sections.items():
      cols = TRAIN_COLS if rows[0][0]['kind'] == 'train' else DOT_COLS
      out += ['', f'### {title}', '', _row(cols), _row(['---'] * len(cols))]
      out += [self.line(req, res) for req, res in rows]
    if not census:
      return out
    out += ['', '### HLO census per row', '']
    for req, res in self.rows:
      census = res.get('census')
      if not census:
        continue
      out.append(f'- {req["row"]}, {"x".join(map(str, req["shape"]))}:')
      out += [
        f'  - GEMM {g["name"]}: {g["kind"]}, {g["types"]}'
        for g in (census['gemms'])
      ]
      for b in census['big']:
        rw = [f'{k} {", ".join(b[k])}' for k in ('reads', 'writes') if b[k]]
        out.append(
          f'  - big {b["opcode"]} {b["name"]}: {"; ".join(rw)} '
          f'({b["nbytes"] / 1e6:.1f} MB)'
        )
    return out

  def write(self, out: pathlib.Path) -> None:
    """gpu.md (the tables, census details) and gpu.json under `out`."""
    (out / 'gpu.md').write_text('\n'.join(self.markdown()) + '\n')
    rows = [dict(request=q, result=r) for q, r in self.rows]
    (out / 'gpu.json').write_text(
      json.dumps(dict(meta=self.meta, rows=rows), indent=1) + '\n'
    )
