"""Built-in cache methods; importing this package registers them."""

from jkv.methods import dense, fake_quant, kivi  # noqa: F401
