"""The engine: quantized dot_general / einsum / conv / ragged_dot.

Layers of aqtr, from the bottom; a module imports only from its own layer
or the ones below (tests/test_layering.py enforces it):

  1. core         this package: jax, numpy and the standard library only;
                  no Fiddle, Flax, Pax or training code.
  2. families     calibrations, numerics, tilings, sparsity, freezers:
                  registered algorithms, importing only the core's base
                  types (core names its defaults by registry name).
  3. tooling      presets, validation, tags, fiddle, fiddlers, selectors,
                  gin, flags: building and editing configs.
  4. frameworks   flax, pax, qt: adapters to model libraries.
  5. job          train, data, demo: the reference training job.

The map of this package, in the order one dot flows through it:

  config        DotGeneralConfig > DotGeneralRaw > TensorConfig (frozen)
  slots         Slot = Pass x Side: the six operand slots and their
                user-facing paths ('fwd.lhs', ...), made in one place
  plan          Plan: every static fact of one call (layouts, forms,
                tiles, reuse, stored operands, mesh axes), built once
  quantizer     one tensor: calibrate -> scale -> numerics -> rounding
  passes        operands in the tiled view; the one contraction core
                (int8 / fp8 / float dispatch, zero points)
  sparsify      pruning a forward operand (and its schedule)
  slot_state    calibration state and schedules as typed per-slot pytrees
  residuals     what the forward keeps for the backward: one record a side
  forward       the forward pass: prune, quantize once, contract, keep
  backward      the one backward routine, symmetric in the side
  geometry      how the operands meet: dense (batched dot) or ragged
                (groups of rows, `aqtr.ragged_dot`); its one refusal
  dot_general   the front end and THE custom VJP (the only one)
  operand       quantize_operand: freeze one operand as the forward would
  einsum, conv, ragged_dot
                front ends onto the same plan, quantizer and contraction
  sharding      meshes: explicit axes, shard_map, quantized all-gathers

One dot: `dot_general` checks its arguments, builds the `Plan` and calls
the custom VJP; `forward` quantizes each operand once (`quantize_tiled`)
and contracts them (`contract`); `backward` runs `operand_gradient` for
each side, reusing the forward quantization or requantizing, with the
same contraction core. Below those: registry, markers, rounding, scale,
algorithms (the base types of the families), dimension_numbers, qtensor,
zero_point, first_order.
"""
