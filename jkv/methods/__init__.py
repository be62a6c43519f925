"""Cache methods and their registry; importing this package registers the built-in methods."""

from jkv.methods.registry import known_methods, make_method, method_class, register  # noqa: F401
from jkv.methods import dense, fake_quant, kivi  # noqa: F401,E402  (each registers itself)
