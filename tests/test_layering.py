"""The layering of aqtr (see aqtr/core/__init__.py), checked on the source.

Static checks read every module with `ast` (imports inside functions
count too); one subprocess imports the core with the package facade
bypassed and checks that no framework or Fiddle module got loaded.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
AQTR = ROOT / 'aqtr'

# Layer of each top-level package/module of aqtr; a module imports only
# from its own layer or lower ones.
LAYERS = {
  'core': 1,
  'calibrations': 2,
  'numerics': 2,
  'tilings': 2,
  'sparsity': 2,
  'transforms': 2,
  'freezers': 2,
  'preset_parts': 3,
  'presets': 3,
  'fp4_recipes': 3,
  'fp8_recipes': 3,
  'validation': 3,
  'tags': 3,
  'fiddle': 3,
  'fiddlers': 3,
  'selectors': 3,
  'rules': 3,
  'maxtext': 3,
  'state': 3,
  'gin': 3,
  'flags': 3,
  'testing': 3,
  'extras': 1,  # Imports nothing of aqtr: the pip hint of every adapter.
  '': 4,  # The facade, aqtr/__init__.py.
  'flax': 5,
  'pax': 5,
  'qt': 5,
  'ptq': 5,
  'lora': 5,
  'checkpoints': 5,
  'train': 6,
  'data': 6,
  'demo': 6,
}
# What the core and the quantizer families may import from outside aqtr.
ENGINE_THIRD_PARTY = {'jax', 'numpy', 'ml_dtypes'}
# The core base types a quantizer family may import.
CORE_BASE = {
  'aqtr.core.algorithms',
  'aqtr.core.codecs',  # A numerics names its storage codec.
  'aqtr.core.markers',
  'aqtr.core.prims',
  'aqtr.core.registry',
  'aqtr.core.rounding',
}
QUANTIZER_FAMILIES = (
  'calibrations',
  'numerics',
  'tilings',
  'sparsity',
  'transforms',
)


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix('').parts
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


@functools.cache
def _modules() -> dict[str, ast.Module]:
  return {
    _module_name(p): ast.parse(p.read_text(), str(p))
    for p in sorted(AQTR.rglob('*.py'))
  }


def _imports(name: str) -> list[tuple[int, str, tuple[str, ...]]]:
  """(line, imported module, imported names) of every import in `name`."""
  out = []
  for node in ast.walk(_modules()[name]):
    if isinstance(node, ast.Import):
      out.extend((node.lineno, a.name, ()) for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      assert not node.level, f'{name}:{node.lineno}: use absolute imports'
      out.append((node.lineno, node.module, tuple(a.name for a in node.names)))
  return out


def _part(module: str) -> str:
  """'aqtr.core.config' -> 'core'; 'aqtr' -> ''."""
  return module.split('.')[1] if module.count('.') else ''


def _targets(module: str, names: tuple[str, ...]) -> list[str]:
  """The aqtr modules an import reaches (`from aqtr import x` -> aqtr.x)."""
  if module == 'aqtr' and names:
    return [
      f'aqtr.{n}' if _part(f'aqtr.{n}') in LAYERS else 'aqtr' for n in names
    ]
  return [module]


def _layer(module: str) -> int:
  part = _part(module)
  assert part in LAYERS, (
    f'{module}: give aqtr/{part} a layer in tests/test_layering.py LAYERS'
  )
  return LAYERS[part]


def test_every_module_has_a_layer():
  for name in _modules():
    _layer(name)


def test_nothing_imports_upward():
  bad = []
  for name in _modules():
    for line, module, names in _imports(name):
      if module.split('.')[0] != 'aqtr':
        continue
      for target in _targets(module, names):
        if _layer(target) > _layer(name):
          bad.append(f'{name}:{line} imports {target}')
  assert not bad, 'upward imports:\n' + '\n'.join(bad)


def _third_party(name: str) -> set[str]:
  roots = {m.split('.')[0] for _, m, _ in _imports(name)}
  return roots - {'aqtr', '__future__'} - set(sys.stdlib_module_names)


def test_core_and_quantizer_families_import_only_jax_and_numpy():
  bad = {}
  for name in _modules():
    part = _part(name)
    if part in ('core',) + QUANTIZER_FAMILIES:
      extra = _third_party(name) - ENGINE_THIRD_PARTY
      if extra:
        bad[name] = sorted(extra)
  assert not bad, f'forbidden imports (no fiddle/flax/pax/train): {bad}'


def test_quantizer_families_import_only_core_base_types():
  bad = []
  for name in _modules():
    part = _part(name)
    if part not in QUANTIZER_FAMILIES:
      continue
    for line, module, names in _imports(name):
      if module.split('.')[0] != 'aqtr':
        continue
      for target in _targets(module, names):
        own = _part(target) == part
        base = target in CORE_BASE or any(
          f'{target}.{n}' in CORE_BASE for n in names
        )
        if not (own or base):
          bad.append(f'{name}:{line} imports {target}')
  assert not bad, (
    f'a family may import only {sorted(CORE_BASE)} and itself:\n'
    + '\n'.join(bad)
  )


def test_no_import_cycle_between_packages():
  graph: dict[str, set[str]] = {}
  for name in _modules():
    if name == 'aqtr':
      continue
    src = _part(name)
    for _, module, names in _imports(name):
      if module.split('.')[0] == 'aqtr':
        for target in _targets(module, names):
          if _part(target) != src:
            graph.setdefault(src, set()).add(_part(target))

  def cycle_from(node, path):
    for nxt in sorted(graph.get(node, ())):
      if nxt in path:
        return path[path.index(nxt) :] + [nxt]
      found = cycle_from(nxt, path + [nxt])
      if found:
        return found
    return None

  for start in sorted(graph):
    found = cycle_from(start, [start])
    assert found is None, 'package import cycle: ' + ' -> '.join(
      p or 'aqtr' for p in found
    )


def _module_aliases(name: str) -> set[str]:
  """Local names of `name` bound to aqtr modules (`import aqtr.x as m`)."""
  aliases = set()
  for node in ast.walk(_modules()[name]):
    if isinstance(node, ast.Import):
      aliases |= {
        a.asname or a.name.split('.')[0]
        for a in node.names
        if a.name.split('.')[0] == 'aqtr'
      }
    elif isinstance(node, ast.ImportFrom):
      aliases |= {
        a.asname or a.name
        for a in node.names
        if f'{node.module}.{a.name}' in _modules()
      }
  return aliases


def test_no_private_name_is_imported_across_modules():
  bad = []
  for name in _modules():
    for line, module, names in _imports(name):
      if module.split('.')[0] == 'aqtr':
        bad.extend(
          f'{name}:{line} imports {module}.{n}'
          for n in names
          if n.startswith('_') and not n.startswith('__')
        )
    aliases = _module_aliases(name)
    for node in ast.walk(_modules()[name]):
      if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in aliases
        and node.attr.startswith('_')
        and not node.attr.startswith('__')
      ):
        bad.append(f'{name}:{node.lineno} uses {node.value.id}.{node.attr}')
  assert not bad, 'private names used across modules:\n' + '\n'.join(bad)


def test_custom_vjp_lives_in_exactly_one_module():
  users = set()
  for name, tree in _modules().items():
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and node.attr == 'custom_vjp') or (
        isinstance(node, ast.alias) and node.name == 'custom_vjp'
      ):
        users.add(name)
  assert users == {'aqtr.core.dot_general'}


def test_the_core_loads_no_fiddle_flax_or_training_code():
  """The core, imported without the `aqtr` facade, stays framework-free.

  `import aqtr` loads the Fiddle tooling on purpose (`aqtr.tags` must be
  active before any fdl.Config is built), so the facade is bypassed: a bare
  `aqtr` package object lets Python import the core modules alone.
  """
  lines = [
    'import sys, types',
    "pkg = types.ModuleType('aqtr')",
    f'pkg.__path__ = [{str(AQTR)!r}]',
    "sys.modules['aqtr'] = pkg",
    'import jax.numpy as jnp',
    'import aqtr.core',
    'from aqtr.core import config, conv, dot_general, einsum, operand',
    # A default config imports the families it names, and nothing more.
    'x = jnp.ones((4, 8))',
    'dn = (((1,), (0,)), ((), ()))',
    'dot_general.dot_general(x, x.T, dn, config.DotGeneralConfig())',
    "banned = ('fiddle', 'flax', 'optax', 'gin', 'orbax', 'aqtr.pax',",
    "          'aqtr.train', 'aqtr.flax', 'aqtr.tags', 'aqtr.fiddle')",
    'print(sorted(m for m in sys.modules if m.startswith(banned)))',
  ]
  code = '\n'.join(lines)
  out = subprocess.run(
    [sys.executable, '-c', code],
    capture_output=True,
    text=True,
    check=True,
    cwd=ROOT,
  )
  assert out.stdout.strip() == '[]', out.stdout


def test_no_import_cycle_between_modules():
  """No module imports one that imports it back, function-level imports
  included (a package's `__init__`, which re-exports, is left out)."""
  packages = {_module_name(p) for p in AQTR.rglob('__init__.py')}
  mods = _modules()
  graph: dict[str, set[str]] = {}
  for name in mods:
    if name in packages:
      continue
    for _, module, names in _imports(name):
      if module.split('.')[0] != 'aqtr':
        continue
      subs = [f'{module}.{n}' for n in names if f'{module}.{n}' in mods]
      for target in subs or [module]:
        if target in mods and target not in packages and target != name:
          graph.setdefault(name, set()).add(target)

  state: dict[str, int] = {}  # 1: on the path, 2: done

  def visit(node, path):
    state[node] = 1
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 1:
        cycle = path[path.index(nxt) :] + [nxt]
        raise AssertionError('module import cycle: ' + ' -> '.join(cycle))
      if nxt not in state:
        visit(nxt, path + [nxt])
    state[node] = 2

  for start in sorted(graph):
    if start not in state:
      visit(start, [start])


def test_every_module_has_at_most_500_lines():
  """Split a module by concept before it grows past 500 lines."""
  lines = {
    p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines())
    for p in sorted(AQTR.rglob('*.py'))
  }
  long = {p: n for p, n in lines.items() if n > 500}
  assert not long, f'modules over 500 lines: {long}'
