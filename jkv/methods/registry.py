"""The registry of cache methods: a name -> method class table that methods join with ``@register``."""

import dataclasses

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


def make_method(name: str, **options) -> CacheMethod:
  """The method called ``name`` with its options; unknown names, unknown options and invalid settings are
  rejected in one line."""
  cls = method_class(name)
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(options) - fields)
  if unknown:
    raise ValueError(f"method {name!r} has no option {', '.join(unknown)}; its options: "
                     f"{', '.join(sorted(fields)) or 'none'}")
  return cls(**options)
