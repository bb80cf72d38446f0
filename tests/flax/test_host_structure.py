"""The interception seam reads one way down (a ratchet on its structure).

- One thread-local in aqtr (the interception Context).
- Weights are never found by walking tracers, and no call is told apart
  by the file it comes from.
- The features (interception: session, analysis, provenance, quantize,
  convert / report / sizes; the PTQ pass and solvers; checkpoints; LoRA)
  never ask which model kind they run: they ask the model's host
  (`aqtr.flax.hosts.of`), implemented once per kind.
- Nothing outside the hosts and `aqtr.flax.kinds` tests for Flax's module
  classes (Fiddle configs are walked as configs: `fdl.Buildable` checks
  outside the features are config traversal).
- The engine calls the contractions `aqtr.core.prims` captured at import.
- One frozen container per framework (`aqtr.flax.frozen`): nnx `Frozen`,
  linen `FrozenBox`.
- One weight-site record (`aqtr.flax.sites.WeightSite`): provenance,
  interception, convert, PTQ and LoRA (linen / nnx and Pax) describe an op
  that reads a weight with it.
"""

from __future__ import annotations

import ast
import pathlib
import re

AQTR = pathlib.Path(__file__).resolve().parents[2] / 'aqtr'
FEATURES = (
  'flax/session.py',
  'flax/analysis.py',
  'flax/provenance.py',
  'flax/quantized.py',
  'flax/serving.py',
  'ptq/api.py',
  'ptq/collect.py',
  'ptq/rewrite.py',
  'checkpoints/api.py',
  'checkpoints/tree.py',
  'lora/adapters.py',
  'lora/merge.py',
  'lora/requant.py',
  'lora/session.py',
)
HOSTS = ('flax/host_nnx.py', 'flax/host_linen.py', 'pax/host.py')
KIND = re.compile(r'isinstance\([^)]*(nn\.Module|nnx\.Module|fdl\.Buildable)')
FLAX_KIND = re.compile(r'isinstance\([^)]*\b(nn\.Module|nnx\.Module)\b')


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


def test_only_kinds_and_hosts_tell_flax_modules_apart():
  """Everywhere else asks `aqtr.flax.kinds` (or the host) for the kind."""
  found = [
    f
    for f, s in _sources()
    if FLAX_KIND.search(s) and f not in (*HOSTS, 'flax/kinds.py')
  ]
  assert found == []


def test_one_host_per_model_kind():
  """Each kind's host is one class, in its own module, on one protocol."""
  found = {}
  for f, s in _sources():
    for m in re.finditer(r'^class (\w+)\((?:host\.)?Host\)', s, re.M):
      found[m.group(1)] = f
  assert found == {
    'NnxHost': 'flax/host_nnx.py',
    'LinenHost': 'flax/host_linen.py',
    'TemplateHost': 'pax/host.py',
  }


def test_no_ptq_targets_of_their_own():
  """PTQ calibrates and solves on hosts (no FlaxTarget / PaxTarget)."""
  for f, s in _sources():
    assert 'FlaxTarget' not in s and 'PaxTarget' not in s, f


def test_engine_contractions_go_through_prims():
  call = re.compile(
    r'^\s+(?:return |out = )?(lax\.(dot_general|ragged_dot|conv_general_'
    r'dilated)|jnp\.einsum)\(',
    re.M,
  )
  for f, s in _sources():
    if f.startswith('core/') and f != 'core/prims.py':
      assert not call.search(s), f


# Flax containers aqtr defines that are not frozen serving values.
_NOT_FROZEN = {
  'Adapter': 'lora/session.py',  # a LoRA adapter (trainable Param)
  'Stats': 'flax/nnx.py',  # CALIBRATE statistics
  'CalibState': 'flax/nnx.py',  # stateful calibrations' stats
  'QuantState': 'flax/rule_state.py',  # the same, of a module's rule ops
  'QuantizedCache': 'flax/kv_cache.py',  # a KV cache stored quantized
}


def _flax_containers() -> dict[str, str]:
  """{class: file} of every nnx Variable / linen AxisMetadata subclass
  (subclasses of aqtr's own such classes included)."""
  bases = re.compile(r'^class (\w+)\(([^)]*)\)', re.M)
  roots = ('Variable', 'Param', 'Cache', 'AxisMetadata')
  classes = [
    (m.group(1), m.group(2), f)
    for f, s in _sources()
    for m in bases.finditer(s)
  ]
  found: dict[str, str] = {}
  grew = True
  while grew:
    grew = False
    for name, base, f in classes:
      parents = [b.strip().split('.')[-1] for b in base.split(',')]
      if name not in found and any(p in roots or p in found for p in parents):
        found[name] = f
        grew = True
  return found


def test_one_frozen_container_per_framework():
  """Every frozen value sits in `Frozen` (nnx) or `FrozenBox` (linen)."""
  found = _flax_containers()
  frozen = {k: v for k, v in found.items() if k not in _NOT_FROZEN}
  assert frozen == {'Frozen': 'flax/frozen.py', 'FrozenBox': 'flax/frozen.py'}
  assert {k: found.get(k) for k in _NOT_FROZEN} == _NOT_FROZEN


# Field names that make a class a record of an op reading a weight.
_WEIGHT_FIELDS = {'param', 'param_path', 'module_path', 'side', 'holder'}
# What a rule matches (an op by where it runs; a Pax config slot): not
# weight sites, they hold no parameter path.
_RULE_VIEWS = {'flax/session.py:OpSite', 'pax/paths.py:OpSite'}


def _records() -> dict[str, set[str]]:
  """{'file:Class': its annotated fields} of every class in aqtr named
  *Site / *Use, or holding a field that names a weight's parameter."""
  found = {}
  for f, s in _sources():
    for node in ast.walk(ast.parse(s)):
      if not isinstance(node, ast.ClassDef):
        continue
      fields = {
        a.target.id
        for a in node.body
        if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
      }
      if node.name.endswith(('Site', 'Use')) or fields & _WEIGHT_FIELDS:
        found[f'{f}:{node.name}'] = fields
  return found


def test_one_weight_site_record():
  """Every feature describes a weight op with `WeightSite` (no copies)."""
  found = _records()
  assert set(found) - _RULE_VIEWS == {'flax/sites.py:WeightSite'}
  for view in _RULE_VIEWS:
    assert not found[view] & _WEIGHT_FIELDS, view
