"""The interception seam reads one way down (a ratchet on its structure).

- One thread-local in aqtr (the interception Context).
- Weights are never found by walking tracers, and no call is told apart
  by the file it comes from.
- The features of stock-model interception (session, analysis,
  provenance, quantize, convert / report / sizes) never ask which model
  kind they run: `aqtr.flax.hosts` does.
- The engine calls the contractions `aqtr.core.prims` captured at import.
"""

from __future__ import annotations

import pathlib
import re

AQTR = pathlib.Path(__file__).resolve().parents[2] / 'aqtr'
FEATURES = (
  'flax/session.py',
  'flax/analysis.py',
  'flax/provenance.py',
  'flax/quantized.py',
  'flax/serving.py',
)
KIND = re.compile(r'isinstance\([^)]*(nn\.Module|nnx\.Module|fdl\.Buildable)')


def _sources():
  for p in sorted(AQTR.rglob('*.py')):
    yield p.relative_to(AQTR).as_posix(), p.read_text()


def test_one_thread_local():
  found = [f for f, s in _sources() if 'threading.local()' in s]
  assert found == ['flax/intercept.py']


def test_no_tracer_walks_or_caller_file_tests():
  for f, s in _sources():
    assert 'in_tracers' not in s, f
    assert 'co_filename' not in s, f


def test_features_do_not_ask_the_model_kind():
  for f in FEATURES:
    assert not KIND.search((AQTR / f).read_text()), f


def test_engine_contractions_go_through_prims():
  call = re.compile(
    r'^\s+(?:return |out = )?(lax\.(dot_general|ragged_dot|conv_general_'
    r'dilated)|jnp\.einsum)\(',
    re.M,
  )
  for f, s in _sources():
    if f.startswith('core/') and f != 'core/prims.py':
      assert not call.search(s), f
