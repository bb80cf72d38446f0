"""`export` a served model to a checkpoint folder, `load` one back.

A checkpoint folder holds `model.safetensors` (or several `*.safetensors`
shards) and `config.json`, a Hugging Face style config whose
`quantization_config` names the layout (`aqtr.checkpoints.layouts`).

Example:
  >>> import jax.numpy as jnp, tempfile, aqtr
  >>> from flax import nnx
  >>> from aqtr.flax import convert, quantize
  >>> q = quantize(nnx.Linear(32, 8, rngs=nnx.Rngs(0)),
  ...     [aqtr.rules.Rule(aqtr.presets.int4_weight_only(), weight=True)])
  >>> x = jnp.ones((2, 32))
  >>> served = convert(q, x)
  >>> d = tempfile.mkdtemp()
  >>> export(served, d, format='gptq')['quantized']
  1
  >>> model = nnx.eval_shape(lambda: nnx.Linear(32, 8, rngs=nnx.Rngs(0)))
  >>> back = load(model, d, x)  # no float kernel is made
  >>> bool((back(x) == served(x)).all())
  True
"""

from __future__ import annotations

import glob
import os
import warnings

import numpy as np

from aqtr.checkpoints import files, naming, tree
from aqtr.checkpoints.layouts import detect, layout
from aqtr.checkpoints.stored import CheckpointError
from aqtr.flax import hosts
from aqtr.flax.quantized import spec_of

__all__ = ['export', 'load', 'qlora', 'read']


def export(
  served,
  folder: str,
  *,
  format: str = 'compressed-tensors',  # noqa: A002 (the HF word)
  variables=None,
  names='hf',
  config: dict | None = None,
  bits: int | None = None,
  **layout_fields,
) -> dict:
  """Writes a served model's weights as a quantized safetensors checkpoint.

  Args:
    served: a converted model (`aqtr.flax.convert`, `aqtr.ptq.quantize`,
      `aqtr.lora.merge`): an nnx module, or a linen module with
      `variables` (its serving variables).
    folder: the output folder (created).
    format: a layout name ('compressed-tensors', 'gptq', 'awq') or a
      `Layout` instance (e.g. `Gptq(scale_dtype='float16')`).
    variables: linen: the serving variables.
    names: 'hf' (the Hugging Face map), a dict {Flax path: tensor name}
      or a callable (`aqtr.checkpoints.naming`).
    config: extra config.json fields (e.g. the model's HF config).
    bits: the bits of every weight (None: the fewest holding its codes).
    **layout_fields: the layout's fields (scale_dtype=...).

  Returns:
    {'quantized': n, 'float': n, 'bytes': file bytes, 'path': file}.
  """
  lay = layout(format, **layout_fields)
  fn = naming.mapper(names)
  frozen, floats = tree.read_frozen(served, variables, bits)
  _warn_activations(served)
  prefix, n = _stack(frozen)
  weights, tensors = {}, {}
  for path, w in frozen.items():
    if isinstance(w, list):  # Stacked layers: one weight per layer.
      for i, x in enumerate(w):
        name = naming.stacked_name(names, path, i, len(prefix))
        weights[naming.module_name(name)] = x
      continue
    weights[naming.module_name(naming.name_of(fn, path))] = w
  for path, a in floats.items():
    a = np.asarray(a)
    if n and path[: len(prefix)] == prefix and a.ndim and a.shape[0] == n:
      for i in range(n):
        b = a[i].T if naming.transposed(path, a.ndim - 1) else a[i]
        name = naming.stacked_name(names, path, i, len(prefix))
        tensors[name] = np.ascontiguousarray(b)
      continue
    if naming.transposed(path, a.ndim):
      a = a.T
    tensors[naming.name_of(fn, path)] = np.ascontiguousarray(a)
  qt, qc = lay.encode(weights)
  clash = sorted(set(qt) & set(tensors))
  if clash:
    raise CheckpointError(f'{clash[0]}: named twice by the name map.')
  tensors.update(qt)
  os.makedirs(folder, exist_ok=True)
  path = os.path.join(folder, files.WEIGHTS)
  files.write(path, tensors)
  files.write_config(folder, dict(config or {}, quantization_config=qc))
  return {
    'quantized': len(weights),
    'float': len(floats),
    'bytes': os.path.getsize(path),
    'path': path,
  }


def _stack(frozen: dict) -> tuple[tuple, int]:
  """(the scanned module's path, the layer count) of the stacked kernels
  (((), 0) when none): their modules' common prefix (one module: its
  parent)."""
  mods = [p[:-1] for p, w in frozen.items() if isinstance(w, list)]
  counts = {len(w) for w in frozen.values() if isinstance(w, list)}
  if not mods:
    return (), 0
  if len(counts) > 1:
    raise CheckpointError(
      f'{tree.path_text(mods[0])}: stacks of {sorted(counts)} layers; a '
      'checkpoint splits one scan over layers.'
    )
  prefix = mods[0] if len(set(mods)) > 1 else mods[0][:-1]
  for m in mods:
    k = 0
    while k < min(len(prefix), len(m)) and prefix[k] == m[k]:
      k += 1
    prefix = prefix[:k]
  return tuple(prefix), counts.pop()


def read(folder: str) -> tuple[dict, dict, dict]:
  """(quantized {module: Stored}, other tensors {name: array}, config)."""
  config = files.read_config(folder)
  lay = detect(config)
  paths = sorted(glob.glob(os.path.join(folder, '*.safetensors')))
  if not paths:
    raise CheckpointError(f'{folder}: no *.safetensors file.')
  tensors = {}
  for p in paths:
    tensors.update(files.read(p))
  weights, rest = lay.decode(tensors, config['quantization_config'])
  return weights, rest, config


def load(
  model, folder: str, *args, variables=None, names='hf', rules=None, **kwargs
):
  """A quantized checkpoint as aqtr frozen weights in a Flax model.

  Each quantized kernel of the checkpoint is put, as stored codes and
  scales, in the place of the model's kernel (served by aqtr's int4 / int8
  weight ops; no float copy of it is made); every other parameter is read
  from the checkpoint's float tensors. Give the model abstractly
  (`nnx.eval_shape(lambda: Model(...))`, linen: `variables=
  jax.eval_shape(model.init, ...)`) and no float weight exists at all.

  Args:
    model: a float (unquantized) nnx Module or linen Module.
    folder: a checkpoint folder (config.json + *.safetensors).
    *args, **kwargs: sample inputs of one call (shapes matter).
    variables: linen: the model's (abstract) variables.
    names: 'hf', a dict {Flax path: tensor name} or a callable.
    rules: the rules the exported model was quantized by, when they
      quantize more than the stored weights (ops without a weight, such
      as attention under a rule without `weight=True`, or the weight ops'
      inputs, as in 'int8'): the checkpoint holds weights only, and these
      rules set the rest. None: only the stored weights are quantized.

  Returns:
    nnx: the serving model (Mode.SERVE). linen: (module, variables).

  Raises:
    CheckpointError: one line naming the tensor and the field for a
      config that disagrees with the tensors, an unknown format, a
      missing tensor or a name map that leaves a tensor or parameter
      unmapped.
  """
  stored, rest, _ = read(folder)
  fn = naming.mapper(names)
  weights, floats, used = {}, {}, set()
  for path, like in _params(model, variables):
    name = naming.name_of(fn, path)
    mod = naming.module_name(name)
    kernel = str(path[-1]) == 'kernel'
    if kernel and mod in stored:
      weights[path] = stored[mod]
      used.add(mod)
      continue
    layers = (
      None if name in rest else _layers(names, path, like, kernel, stored, rest)
    )
    if layers is not None:  # Stacked layers: one tensor per layer.
      used.update(layers)
      if kernel and layers[0] in stored:
        weights[path] = [stored[m] for m in layers]
      else:
        one = len(like.shape) - 1
        floats[path] = np.stack(
          [
            rest[m].T if naming.transposed(path, one) else rest[m]
            for m in layers
          ]
        )
      continue
    if name not in rest:
      raise CheckpointError(
        f'{name}: missing tensor (for parameter {tree.path_text(path)}).'
      )
    a = rest[name]
    if naming.transposed(path, len(like.shape)):
      a = a.T
    floats[path] = a
    used.add(name)
  left = sorted(set(stored) - used) + sorted(set(rest) - used)
  if left:
    raise CheckpointError(
      f'{left[0]}: no model parameter maps to this tensor (argument names).'
    )
  return tree.build(model, weights, floats, args, kwargs, variables, rules)


def qlora(
  model,
  folder: str,
  lora,
  *args,
  variables=None,
  names='hf',
  rules=None,
  seed: int = 0,
  **kwargs,
):
  """A quantized checkpoint as the frozen base of LoRA adapters (QLoRA).

  `load`s the checkpoint (codes and scales, no float copy of a quantized
  weight at any point) and attaches adapters (`aqtr.lora.attach`) to every
  stored quantized weight, each with its own format as
  `LoraConfig.base`: train them with `aqtr.lora.optimizer` /
  `nnx_optimizer`, then `aqtr.lora.merge` (requantize='base': each
  weight back in its checkpoint format) and `export` again.

  Args:
    model: a float nnx or linen Module, best abstract (`nnx.eval_shape`).
    folder: a checkpoint folder.
    lora: an `aqtr.lora.LoraConfig` (rank, alpha, dropout; its `base` is
      set per weight from the checkpoint).
    *args, **kwargs: sample inputs of one call.
    variables, names, rules: as for `load`.
    seed: PRNG seed of the adapters' A matrices.

  Returns:
    nnx: the LoRA model. linen: (LoRA module, variables).
  """
  import dataclasses  # noqa: PLC0415

  from aqtr import lora as lora_lib  # noqa: PLC0415 (lora builds on flax)
  from aqtr.rules import Rule  # noqa: PLC0415

  if not isinstance(lora, lora_lib.LoraConfig):
    raise TypeError(
      f'aqtr.checkpoints.qlora: lora must be an aqtr.lora.LoraConfig, got '
      f'{lora!r} (argument lora).'
    )
  served = load(
    model,
    folder,
    *args,
    variables=variables,
    names=names,
    rules=rules,
    **kwargs,
  )
  host = hosts.served(served, who='aqtr.checkpoints.qlora')
  pairs = [
    (
      Rule(path=r.path, op=r.op, weight=True),
      dataclasses.replace(lora, base=r.config),
    )
    for r in spec_of(host.model).rules
    if r.weight is True and r.config is not None
  ]
  return lora_lib.attach(
    host.model, pairs, *args, variables=host.variables, seed=seed, **kwargs
  )


def _warn_activations(served) -> None:
  """Warns (one line) when the model's rules may quantize what a
  checkpoint does not hold: ops without a weight, or a weight op's input."""
  try:
    spec = spec_of(served)
  except ValueError:  # Not quantized by rules (Pax injection, aqtr ops).
    return
  for i, (r, cfg) in enumerate(zip(spec.rules, spec.configs, strict=True)):
    if cfg is None or cfg.is_float:
      continue
    if cfg.fwd.lhs.quantized or r.weight is not True:
      warnings.warn(
        f'aqtr.checkpoints.export: rule {i} {r.label()} can quantize '
        "activations (an op's input, or ops without a weight such as "
        'attention); the checkpoint holds weights only: give load the '
        'same rules (argument rules) to serve them as exported.',
        UserWarning,
        stacklevel=3,
      )
      return


def _layers(names, path, like, kernel, stored, rest):
  """The per-layer tensor (or module) names of a stacked parameter, or
  None when the checkpoint holds no such layers."""
  if not like.shape:
    return None
  n = like.shape[0]
  hf = names is None or names == 'hf'
  for at in range(1, len(path)) if hf else (0,):
    try:
      got = [naming.stacked_name(names, path, i, at) for i in range(n)]
    except CheckpointError:
      return None
    mods = [naming.module_name(g) for g in got]
    if kernel and all(m in stored for m in mods):
      return mods
    if all(g in rest for g in got):
      return got
  return None


def _params(model, variables):
  """(path, shape-like) of every parameter of a float model."""
  host = hosts.of(model, variables, who='aqtr.checkpoints.load')
  yield from host.params().items()
