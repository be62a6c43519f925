"""Pallas kernels for jkv (imported as ``jkv_kernels``), each beside a plain-jnp reference of the same function.

Arrays in, arrays out: nothing here knows about models or cache methods.
"""
