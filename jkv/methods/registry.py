"""The registry of cache methods: a name -> method class table that methods join with ``@register``.

A method class may name presets, ``presets = {"paper": {"group_size": 128, ...}}`` (a class attribute, not a
setting): option sets that ``make_method(name, preset=...)`` starts from (``jkv ... --preset paper``)."""

import dataclasses
from typing import Optional

from jkv.cache import CacheMethod

_REGISTRY: dict[str, type] = {}


def register(cls):
  """Class decorator: make a method reachable by its ``name``."""
  _REGISTRY[cls.name] = cls
  return cls


def known_methods() -> list[str]:
  return sorted(_REGISTRY)


def method_class(name: str) -> type:
  if name not in _REGISTRY:
    raise ValueError(f"unknown cache method {name!r}; known methods: {', '.join(known_methods())}")
  return _REGISTRY[name]


def presets(name: str) -> dict:
  """The presets of method ``name``: {preset: options}."""
  return getattr(method_class(name), "presets", {})


def make_method(name: str, preset: Optional[str] = None, **options) -> CacheMethod:
  """The method called ``name`` with its options, over the options of ``preset`` if one is named; unknown names,
  presets and options and invalid settings are rejected in one line."""
  cls = method_class(name)
  if preset is not None:
    known = presets(name)
    if preset not in known:
      raise ValueError(f"method {name!r} has no preset {preset!r}; its presets: {', '.join(known) or 'none'}")
    options = {**known[preset], **options}
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(options) - fields)
  if unknown:
    raise ValueError(f"method {name!r} has no option {', '.join(unknown)}; its options: "
                     f"{', '.join(sorted(fields)) or 'none'}")
  return cls(**options)
