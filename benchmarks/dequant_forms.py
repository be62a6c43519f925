"""Does the jnp form of the in-register dequantization change the code Triton emits? (issue 9)

Nsight Compute's SASS counts (``ncu_opcodes.py``) show the fused kernel spending its instructions on unpacking:
each thread unpacks one code of each of many words, so every code gets its own copy of its group's scale and
zero-point, converted from fp16 (``HADD2.F32``). This script swaps other forms of
``quantization.dequantize_packed_last_axis`` into the library kernel (``dequant_attention``), checks each
against the reference (``kernel_decode.check_fused_against_reference``: KIVI-2/4 and every method layout), and
times KIVI-2 at B=8, L=32768 and B=256, L=4096 with the kernel's default config, all in one run:

- ``library``: the library's form, codes [..., n, P] with the scales broadcast per word then per code;
- ``codes_by_position``: codes [..., P, n] (a word's P codes along the second-last axis), then swapped;
- ``codes_by_position_f32``: the same, cast to the dot dtype after the swap instead of before;
- ``scale_per_group``: codes reshaped per group [..., groups, G] and each group's scale broadcast over it.

    python benchmarks/dequant_forms.py --out $OUT/dequant_forms.json     # GPU
    python benchmarks/dequant_forms.py --check-only                      # any machine: the forms agree
"""

import argparse
import datetime
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import kernel_decode
from jkv_kernels import dequant_attention, quantization


def _word_scales(scale, zero, lead, n, groups):
  """Scale and zero per word [..., n] in fp32."""
  per_word = lambda a: jnp.broadcast_to(a.astype(jnp.float32)[..., None], (*lead, groups, n // groups))
  return per_word(scale).reshape(*lead, n), per_word(zero).reshape(*lead, n)


def codes_by_position(words, scale, zero, *, bits, group_size, dtype, cast_last=False):
  per_word = 32 // bits
  *lead, n = words.shape
  s, z = _word_scales(scale, zero, lead, n, max(1, n * per_word // group_size))
  shifts = (jnp.arange(per_word, dtype=jnp.uint32) * bits)[:, None]
  c = quantization.codes_as_float32((words[..., None, :] >> shifts) & jnp.uint32(2**bits - 1))  # [..., P, n]
  x = c * s[..., None, :] + z[..., None, :]
  if cast_last:
    return jnp.swapaxes(x, -1, -2).reshape(*lead, n * per_word).astype(dtype)
  return jnp.swapaxes(x.astype(dtype), -1, -2).reshape(*lead, n * per_word)


def scale_per_group(words, scale, zero, *, bits, group_size, dtype):
  per_word = 32 // bits
  *lead, n = words.shape
  groups = max(1, n * per_word // group_size)
  shifts = jnp.arange(per_word, dtype=jnp.uint32) * bits
  c = quantization.codes_as_float32((words[..., None] >> shifts) & jnp.uint32(2**bits - 1))
  c = c.reshape(*lead, groups, n * per_word // groups)
  s = scale.astype(jnp.float32).reshape(*lead, groups, 1)
  z = zero.astype(jnp.float32).reshape(*lead, groups, 1)
  return (c * s + z).reshape(*lead, n * per_word).astype(dtype)


FORMS = {
    "library": quantization.dequantize_packed_last_axis,
    "codes_by_position": codes_by_position,
    "codes_by_position_f32": lambda *a, **k: codes_by_position(*a, cast_last=True, **k),
    "scale_per_group": scale_per_group,
}
SHAPES = ((8, 32768), (256, 4096))


def check_forms_agree():
  """Every form gives the library's values bit for bit on random words (widths 1-8, tiles across and inside
  groups)."""
  for bits in (1, 2, 4, 8):
    for n, group in ((4, 32), (8, 32), (2, 64), (16, 32)):
      groups = max(1, n * (32 // bits) // group)
      keys = jax.random.split(jax.random.key(bits), 3)
      words = jax.random.bits(keys[0], (3, 5, n), jnp.uint32)
      scale = jax.random.uniform(keys[1], (3, 5, groups)).astype(jnp.float16)
      zero = jax.random.normal(keys[2], (3, 5, groups)).astype(jnp.float16)
      want = np.asarray(FORMS["library"](words, scale, zero, bits=bits, group_size=group, dtype=jnp.float32))
      for name, form in FORMS.items():
        got = np.asarray(form(words, scale, zero, bits=bits, group_size=group, dtype=jnp.float32))
        if not np.array_equal(got, want):
          raise SystemExit(f"{name} differs from the library form at {bits} bits, n={n}, G={group}")
  print("every form equals the library's, bit for bit")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", type=pathlib.Path)
  parser.add_argument("--check-only", action="store_true", help="only check that the forms agree (any machine)")
  args = parser.parse_args()
  check_forms_agree()
  if args.check_only:
    return
  device = jax.devices()[0]
  settings = kernel_decode.Settings(repetitions=20, calls_per_repetition=10)
  date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  records = []
  for name, form in FORMS.items():
    dequant_attention.dequantize_packed_last_axis = form  # the kernel body calls it by this module-level name
    kernel_decode.check_fused_against_reference(settings, {})
    for batch, seq_len in SHAPES:
      shape = kernel_decode.Shape(batch, seq_len)
      sets = [kernel_decode.kivi_inputs(shape, 2, seed=seed) for seed in range(4 if batch == 8 else 2)]
      median_us, _ = kernel_decode.time_calls(kernel_decode.fused({}, False), sets, settings)
      records.append(dict(form=name, bits=2, batch=batch, seq_len=seq_len, median_us=round(median_us, 2),
                          device=device.device_kind, jax_version=jax.__version__, date=date))
      print(f"{name} KIVI-2 B={batch} L={seq_len}: {median_us:.1f} µs", flush=True)
  if args.out:
    args.out.write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
  sys.exit(main())
