"""quantize_operand and state: one clear line, never a silent stateless
freeze of a stateful calibration."""

from __future__ import annotations

import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

import aqtr
from aqtr import presets

DN = (((1,), (0,)), ((), ()))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def _lsq():
  cfg = presets.int4_lsq()
  x, w = jnp.ones((2, 16)), jnp.linspace(-1, 1, 64).reshape(16, 4)
  return cfg, w, aqtr.state.init(x, w, DN, cfg)


def test_stateful_config_without_state_is_one_line():
  cfg, w, _ = _lsq()
  with pytest.raises(ValueError, match=r'calibrates with Lsq, which keeps st'):
    aqtr.quantize_operand(w, DN, cfg)


def test_whole_state_tree_names_the_entry():
  cfg, w, s = _lsq()
  with pytest.raises(ValueError, match=r"whole state tree; pass state\['fwd"):
    aqtr.quantize_operand(w, DN, cfg, state=s)
  with pytest.raises(ValueError, match=r"got keys \['stats'\]; pass"):
    aqtr.quantize_operand(w, DN, cfg, state={'stats': {}})
  q = aqtr.quantize_operand(w, DN, cfg, state=s['fwd.rhs'])
  assert q.qvalue.shape[-1] == 4


_SCRIPT = """
import sys, jax, jax.numpy as jnp, numpy as np, aqtr
from aqtr import presets
dn = (((1,), (0,)), ((), ()))
for case in sys.argv[1:]:
  name, k = case.split(':')
  k = int(k)
  cfg = getattr(presets, name)()
  kw = {'key': jax.random.key(0)} if name.endswith('training') else {}
  x = jax.random.normal(jax.random.key(k), (4, k))
  w = jax.random.normal(jax.random.key(100 + k), (k, 8))
  qw = aqtr.quantize_operand(w, dn, cfg)
  got = aqtr.dot_general(x, qw, dn, cfg, **kw)  # op by op
  np.testing.assert_array_equal(got, aqtr.dot_general(x, w, dn, cfg, **kw))
  f = jax.jit(lambda x, w, b: aqtr.dot_general(x, w, dn, cfg, **kw) + b)
  b = jnp.ones(8)
  np.testing.assert_array_equal(f(x, qw, b), f(x, w, b), err_msg=name)
"""


def _serves_what_it_trains(*cases: str) -> None:
  """Frozen == training dot, op by op and inside a jitted program with an
  add after it, compiled with XLA's DEFAULT flags (the test session's low
  LLVM optimization level never contracts a multiply-add into an FMA)."""
  env = dict(os.environ, XLA_FLAGS='', JAX_PLATFORMS='cpu')
  got = subprocess.run(
    [sys.executable, '-c', _SCRIPT, *cases],
    env=env,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert got.returncode == 0, got.stderr[-2000:]


def test_frozen_nvfp4_serves_what_it_trains_at_k32():
  """NVFP4 at K = 32 (two 16-wide blocks) used to differ by 1 ULP: the
  training program fused its weight scales into the block sum."""
  _serves_what_it_trains('nvfp4:32', 'nvfp4_training:32')


@pytest.mark.slow
def test_frozen_weights_serve_what_they_train():
  _serves_what_it_trains(
    'nvfp4:64', 'nvfp4:16', 'mxfp4_weight_only:64', 'int8:64', 'fp8:48'
  )
