"""jkv: LLM inference in JAX with compressed KV caches (KIVI, ZipCache, OTT, SpeCache) and fused Pallas kernels.

The one-hand API (``jkv.api``)::

    import jkv
    model = jkv.Model.load("default")
    out = model.generate(["What is the capital of France?"], method="kivi", bits=2, max_new_tokens=32)
    print(out.texts[0], out.stats.kv_device_bytes, out.stats.dense_kv_bytes)

Names are imported on first use: ``import jkv`` alone loads no jax, so the ``jkv`` command starts quickly.
"""

import importlib

_EXPORTS = {
    "Model": "jkv.api",  # Model.load(name_or_path, dtype), model.generate(prompts, method, **options)
    "Generation": "jkv.api",  # what generate returns: texts, tokens, prompt_tokens, stats
    "Stats": "jkv.api",  # KV bytes on the device and host, dense bytes, timings
    "convert": "jkv.api",  # convert(src, out, dtype) -> Model
    "device_info": "jkv.api",  # the accelerator and whether the Pallas kernels run on it
    "DeviceMemoryError": "jkv.memory",  # a batch that does not fit the device: what fits (a MemoryError)
    "make_method": "jkv.methods",  # make_method(name, **options) -> a method object
    "known_methods": "jkv.methods",  # the registered method names
}

__all__ = ["DeviceMemoryError", "Generation", "Model", "Stats", "convert", "device_info", "known_methods",
           "make_method"]


def __getattr__(name):
  if name in _EXPORTS:
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
  raise AttributeError(f"module 'jkv' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_EXPORTS))
