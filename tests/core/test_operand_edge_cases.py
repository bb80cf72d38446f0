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
FMA = (
  'engine numerics: XLA:CPU fuses the NVFP4 tile sum into a multiply-add '
  'in one program and not the other'
)


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
import sys, jax, numpy as np, aqtr
from aqtr import presets
dn = (((1,), (0,)), ((), ()))
cfg = getattr(presets, sys.argv[1])()
k = int(sys.argv[2])
kw = {'key': jax.random.key(0)} if sys.argv[1].endswith('training') else {}
for i in range(3):
  x = jax.random.normal(jax.random.key(i), (4, k))
  w = jax.random.normal(jax.random.key(100 + i), (k, 8))
  qw = aqtr.quantize_operand(w, dn, cfg)
  got = aqtr.dot_general(x, qw, dn, cfg, **kw)
  np.testing.assert_array_equal(got, aqtr.dot_general(x, w, dn, cfg, **kw))
"""


def _serves_what_it_trains(preset: str, k: int) -> None:
  """Frozen == training dot, compiled with XLA's DEFAULT flags (the test
  session's low LLVM optimization level never fuses a multiply-add)."""
  env = dict(os.environ, XLA_FLAGS='', JAX_PLATFORMS='cpu')
  got = subprocess.run(
    [sys.executable, '-c', _SCRIPT, preset, str(k)],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert got.returncode == 0, got.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize(
  'preset, k',
  [('mxfp4_weight_only', 64), ('int8', 64), ('nvfp4', 16)],
)
def test_frozen_weights_serve_what_they_train(preset, k):
  _serves_what_it_trains(preset, k)


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason=FMA)
@pytest.mark.parametrize('preset', ['nvfp4', 'nvfp4_training'])
def test_frozen_nvfp4_serves_what_it_trains_at_k32(preset):
  _serves_what_it_trains(preset, 32)
