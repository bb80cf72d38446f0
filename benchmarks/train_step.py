"""Speed of a jitted train step: float vs aqtr int8 vs AQT vs Qwix.

Two models, each a jitted step (forward, backward, Adam update):

  mlp  784-1024-1024-1024-10, batch 256, ReLU
  lm   the main job's default transformer LM: bytes (vocab 256), 2 blocks,
       d_model 128, 4 heads, MLP 512, batch 16 x 64 tokens

The models are written once, as functions of a `dot(lhs, rhs, dn)`; every
weight contraction goes through it (attention's QK^T and PV stay float)
and each implementation only swaps the dot: `lax.dot_general` (float),
`aqtr.dot_general` with `aqtr.presets.int8()` (int8 forward, dlhs and
drhs), AQT (`aqtp`) `fully_quantized(8, 8)`, Qwix `dot_general_qt` with
int8 operands and gradients. For the LM, two more rows time the job's own
model (`aqtr.pax` TransformerLm, float and with int8 injected). AQT and
Qwix appear when installed (`pip install -e '.[bench]'`).

One process, interleaved rounds (each implementation is timed once per
round, in turn), minimum over rounds; `x float` = float min time / min
time (higher is faster); `cpu ms` / `cpu x` the same in process CPU time
(all threads; steadier than wall time on a shared machine); compile time
as measured by AOT compilation.

Run: python benchmarks/train_step.py [--rounds 10] [--models mlp lm] [--json]
(`--json` prints one JSON row per line, for benchmarks/before_after.py.)
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import host
import jax
import jax.numpy as jnp
import optax
from jax import lax

import aqtr

DN = (((1,), (0,)), ((), ()))  # x[M, K] . w[K, N]

Dot = Callable[..., jax.Array]


def _aqtr_int8() -> Dot:
  cfg = aqtr.presets.int8()
  return lambda lhs, rhs, dn: aqtr.dot_general(lhs, rhs, dn, cfg)


def _aqt_int8() -> Dot | None:
  try:
    from aqt.jax.v2 import config as aqt_config
  except ImportError:
    return None
  dg = aqt_config.fully_quantized(
    fwd_bits=8, bwd_bits=8, use_stochastic_rounding=False
  )
  return lambda lhs, rhs, dn: dg(lhs, rhs, dn)


def _qwix_int8() -> Dot | None:
  try:
    from qwix._src.core import dot_general_qt
  except ImportError:
    return None
  cfg = dot_general_qt.DotGeneralQtConfig(
    lhs_qtype='int8',
    rhs_qtype='int8',
    dlhs_grad_qtype='int8',
    drhs_grad_qtype='int8',
  )
  return lambda lhs, rhs, dn: dot_general_qt.dot_general_qt(lhs, rhs, dn, cfg)


def dots() -> dict[str, Dot]:
  """The dot implementations available here, float first."""
  out = {
    'float': lambda lhs, rhs, dn: lax.dot_general(lhs, rhs, dn),
    'aqtr int8': _aqtr_int8(),
  }
  for name, make in (('aqt int8', _aqt_int8), ('qwix int8', _qwix_int8)):
    f = make()
    if f is not None:
      out[name] = f
  return out


def _dense(dot: Dot, x: jax.Array, w: jax.Array) -> jax.Array:
  """x[..., K] . w[K, N] as one 2-D dot (every library supports it)."""
  y = dot(x.reshape(-1, x.shape[-1]), w, DN)
  return y.reshape(*x.shape[:-1], w.shape[-1])


def _xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(
    logits.astype(jnp.float32), labels
  ).mean()


# --- MLP 784-1024-1024-1024-10 ---------------------------------------------


def mlp_init(key: jax.Array, sizes=(784, 1024, 1024, 1024, 10)) -> dict:
  ks = jax.random.split(key, len(sizes) - 1)
  return {
    f'w{i}': jax.random.normal(k, (a, b)) / jnp.sqrt(a)
    for i, (k, a, b) in enumerate(zip(ks, sizes[:-1], sizes[1:], strict=True))
  } | {f'b{i}': jnp.zeros(b) for i, b in enumerate(sizes[1:])}


def mlp_loss(dot: Dot, p: dict, x: jax.Array, y: jax.Array) -> jax.Array:
  n = len([k for k in p if k.startswith('w')])
  for i in range(n):
    x = _dense(dot, x, p[f'w{i}']) + p[f'b{i}'][None]
    if i < n - 1:
      x = jax.nn.relu(x)
  return _xent(x, y)


def mlp_data(key: jax.Array, batch: int = 256):
  kx, ky = jax.random.split(key)
  return (
    jax.random.normal(kx, (batch, 784)),
    jax.random.randint(ky, (batch,), 0, 10),
  )


# --- Transformer LM (the job's default sizes) ------------------------------

LM = dict(vocab=256, d=128, layers=2, heads=4, hidden=512, batch=16, seq=64)


def lm_init(key: jax.Array) -> dict:
  d, h, v = LM['d'], LM['hidden'], LM['vocab']
  keys = iter(jax.random.split(key, 4 + 6 * LM['layers']))

  def w(a, b):
    return jax.random.normal(next(keys), (a, b)) / jnp.sqrt(a)

  p = {
    'embed': 0.02 * jax.random.normal(next(keys), (v, d)),
    'pos': 0.02 * jax.random.normal(next(keys), (LM['seq'], d)),
    'out': w(d, v),
  }
  for i in range(LM['layers']):
    p[f'l{i}'] = {
      'q': w(d, d),
      'k': w(d, d),
      'v': w(d, d),
      'o': w(d, d),
      'wi': w(d, h),
      'wo': w(h, d),
    }
  return p


def _norm(x: jax.Array) -> jax.Array:
  m = x.mean(-1, keepdims=True)
  return (x - m) * lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-6)


def lm_loss(dot: Dot, p: dict, ids: jax.Array, y: jax.Array) -> jax.Array:
  b, t = ids.shape
  nh = LM['heads']
  x = p['embed'][ids] + p['pos'][None, :t]
  mask = jnp.tril(jnp.ones((t, t), bool))
  for i in range(LM['layers']):
    q_ = p[f'l{i}']
    h = _norm(x)

    def heads(z):
      return z.reshape(b, t, nh, -1)

    q, k, v = (heads(_dense(dot, h, q_[n])) for n in 'qkv')
    s = jnp.einsum('bqhd,bkhd->bhqk', q, k) / jnp.sqrt(q.shape[-1])
    a = jax.nn.softmax(jnp.where(mask[None, None], s, -1e30))
    o = jnp.einsum('bhqk,bkhd->bqhd', a, v).reshape(b, t, -1)
    x = x + _dense(dot, o, q_['o'])
    h = jax.nn.gelu(_dense(dot, _norm(x), q_['wi']))
    x = x + _dense(dot, h, q_['wo'])
  return _xent(_dense(dot, _norm(x), p['out']), y)


def lm_data(key: jax.Array):
  ids = jax.random.randint(key, (LM['batch'], LM['seq'] + 1), 0, LM['vocab'])
  return ids[:, :-1], ids[:, 1:]


def _pax_steps() -> dict[str, tuple[Callable, dict]]:
  """The job's own LM (aqtr.pax), float and int8-injected: (loss, params)."""
  try:
    from aqtr.train import models
  except ImportError:
    return {}
  tpl = models.lm(
    LM['vocab'],
    LM['seq'],
    LM['d'],
    LM['layers'],
    LM['heads'],
    LM['hidden'] // LM['d'],
  )
  out = {}
  ids = jnp.zeros((LM['batch'], LM['seq']), jnp.int32)
  params = None
  for name, cfg in (
    ('float (pax LM)', None),
    ('aqtr int8 (pax LM)', aqtr.presets.int8()),
  ):
    module = models.build(models.inject(tpl, cfg)[0])
    if params is None:
      params = module.init(jax.random.key(0), ids)['params']

    def loss(p, x, y, module=module):
      return _xent(module.apply({'params': p}, x), y)

    out[name] = (loss, params)
  return out


# --- Timing ----------------------------------------------------------------


def _step(loss: Callable, tx: optax.GradientTransformation) -> Callable:
  def step(params, opt_state, x, y):
    value, grads = jax.value_and_grad(loss)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return step


def bench(model: str, rounds: int) -> list[dict]:
  """Min step time of every implementation on `model` ('mlp' or 'lm')."""
  key = jax.random.key(0)
  init, loss, data = {
    'mlp': (mlp_init, mlp_loss, mlp_data),
    'lm': (lm_init, lm_loss, lm_data),
  }[model]
  params, (x, y) = init(key), data(jax.random.key(1))
  tx = optax.adam(1e-3)
  cases = {
    name: (lambda p, a, b, dot=dot: loss(dot, p, a, b), params)
    for name, dot in dots().items()
  }
  if model == 'lm':
    cases |= _pax_steps()
  fns, compile_s = {}, {}
  for name, (fn, p) in cases.items():
    state = tx.init(p)
    t = time.perf_counter()
    try:
      c = jax.jit(_step(fn, tx)).lower(p, state, x, y).compile()
    except Exception as e:  # A competitor that fails is reported, not fatal.
      print(f'  {model} {name}: failed ({type(e).__name__}: {e})'[:200])
      continue
    compile_s[name] = time.perf_counter() - t
    jax.block_until_ready(c(p, state, x, y))  # Warm up.
    fns[name] = (c, (p, state, x, y))
  best = dict.fromkeys(fns, float('inf'))
  cpu = dict.fromkeys(fns, float('inf'))
  for _ in range(rounds):
    for name, (c, args) in fns.items():
      t, u = time.perf_counter(), time.process_time()
      jax.block_until_ready(c(*args))
      best[name] = min(best[name], time.perf_counter() - t)
      cpu[name] = min(cpu[name], time.process_time() - u)
  rows = []
  for name in fns:
    base = 'float (pax LM)' if 'pax' in name else 'float'
    rows.append(
      dict(
        model=model,
        impl=name,
        ms=best[name] * 1e3,
        speed=best[base] / best[name],
        cpu_ms=cpu[name] * 1e3,
        cpu_speed=cpu[base] / cpu[name],
        compile_s=compile_s[name],
        compile_x=compile_s[name] / compile_s[base],
      )
    )
  return rows


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--rounds', type=int, default=10)
  p.add_argument('--models', nargs='*', default=['mlp', 'lm'])
  p.add_argument(
    '--json', action='store_true', help='JSON rows (for before_after.py)'
  )
  a = p.parse_args(argv)
  if a.json:
    for m in a.models:
      for r in bench(m, a.rounds):
        print(json.dumps(r), flush=True)
    return
  print(
    f'jax {jax.__version__}, {jax.devices()[0].device_kind}, '
    f'rounds={a.rounds}; x float = float min time / min time '
    '(higher is faster)'
  )
  print(f'Host: {host.cpu_model()}; load average {host.load_average()}')
  print(
    f'| {"model":<5} | {"impl":<19} | {"ms/step":>8} | {"x float":>7} '
    f'| {"cpu ms":>7} | {"cpu x":>5} | {"compile s":>9} | {"compile x":>9} |'
  )
  widths = (7, 21, 10, 9, 9, 7, 11, 11)
  print('|' + '|'.join('-' * n for n in widths) + '|')
  for m in a.models:
    for r in bench(m, a.rounds):
      print(
        f'| {r["model"]:<5} | {r["impl"]:<19} | {r["ms"]:>8.2f} | '
        f'{r["speed"]:>7.2f} | {r["cpu_ms"]:>7.2f} | '
        f'{r["cpu_speed"]:>5.2f} | {r["compile_s"]:>9.2f} | '
        f'{r["compile_x"]:>9.2f} |',
        flush=True,
      )
  print(f'(end: load average {host.load_average()})')


if __name__ == '__main__':
  main()
