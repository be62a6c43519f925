"""Built-in cache methods; importing this package registers them."""

from jkv.methods import dense  # noqa: F401
