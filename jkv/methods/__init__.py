"""Cache methods and their registry; importing this package registers the built-in methods."""

from jkv.methods.registry import known_methods, make_method, method_class, presets, register  # noqa: F401
# Each module registers its method on import.
from jkv.methods import dense, fake_quant, kivi, ott, specache, zipcache  # noqa: F401,E402
