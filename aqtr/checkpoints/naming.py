"""Tensor names from Flax parameter paths, and back.

The Hugging Face map ('hf', the default) names a Flax parameter as the HF
Flax / PyTorch models do: the module path joined by '.', then the leaf:

  model/layers/0/self_attn/q_proj/kernel
    <-> model.layers.0.self_attn.q_proj.weight
  .../bias -> .bias,  LayerNorm/RMSNorm .../scale -> .weight,
  Embed .../embedding -> .weight

A 2-D `kernel` [d_in, d_out] is stored transposed, as torch's Linear
weight [d_out, d_in]. A quantized kernel is stored under its module name
(`model.layers.0.self_attn.q_proj`, plus the layout's suffixes). A user
map is a dict {Flax path ('a/b/kernel'): tensor name} or a callable
(Flax path) -> tensor name or None (None: unmapped, an error).

Stacked layers (a scan over layers: parameters with a leading layer axis)
are stored one tensor per layer under the standard names: 'hf' puts the
layer index after the scanned module (`layers/mlp/up/kernel`, layer 2 ->
`layers.2.mlp.up.weight`); a user map writes `{layer}` where it goes
(`'model.layers.{layer}.mlp.up_proj.weight'`).

Example:
  >>> tensor_name(('model', 'layers', 0, 'q_proj', 'kernel'))
  'model.layers.0.q_proj.weight'
  >>> module_name('model.layers.0.q_proj.weight')
  'model.layers.0.q_proj'
"""

from __future__ import annotations

from aqtr.checkpoints.stored import CheckpointError

__all__ = [
  'mapper',
  'module_name',
  'name_of',
  'stacked_name',
  'tensor_name',
  'transposed',
]

_LEAVES = {'kernel': 'weight', 'scale': 'weight', 'embedding': 'weight'}


def tensor_name(path: tuple) -> str:
  """The Hugging Face name of the Flax parameter at `path`."""
  *mods, leaf = (str(k) for k in path)
  return '.'.join([*mods, _LEAVES.get(leaf, leaf)])


def module_name(tensor: str) -> str:
  """The module name a quantized kernel's tensors are stored under."""
  return tensor[: -len('.weight')] if tensor.endswith('.weight') else tensor


def transposed(path: tuple, ndim: int) -> bool:
  """Whether the tensor is the parameter transposed (a 2-D kernel)."""
  return str(path[-1]) == 'kernel' and ndim == 2


def mapper(names):
  """names ('hf', dict or callable) -> a function path tuple -> name."""
  if names is None or names == 'hf':
    return tensor_name
  if isinstance(names, dict):
    return lambda path: names.get('/'.join(str(k) for k in path))
  if callable(names):
    return lambda path: names('/'.join(str(k) for k in path))
  raise CheckpointError(
    f"names must be 'hf', a dict or a callable, got {names!r} (argument names)."
  )


def name_of(fn, path: tuple) -> str:
  """fn(path), or one line naming the unmapped parameter."""
  name = fn(path)
  if not isinstance(name, str) or not name:
    raise CheckpointError(
      f'{"/".join(str(k) for k in path)}: the name map gives no tensor name '
      "(argument names); add it, or use names='hf'."
    )
  return name


def stacked_name(names, path: tuple, layer: int, at: int) -> str:
  """The name of layer `layer` of the stacked parameter at `path`.

  Args:
    names: the name map ('hf', dict or callable).
    path: the parameter's path.
    layer: the layer index.
    at: 'hf': the index goes after `path[:at]` (the scanned module).

  Returns:
    'hf': the HF name of `path` with the index inserted; a user map: its
    name with '{layer}' replaced by the index.
  """
  if names is None or names == 'hf':
    return tensor_name((*path[:at], layer, *path[at:]))
  name = name_of(mapper(names), path)
  if '{layer}' not in name:
    raise CheckpointError(
      f'{"/".join(str(k) for k in path)}: a stacked parameter (one tensor '
      f"per layer), but its name {name!r} has no '{{layer}}' (argument "
      'names); write where the layer index goes.'
    )
  return name.replace('{layer}', str(layer))
