"""Attention kernels, one folder each: the Pallas GPU and TPU lowerings, the
XLA path used on CPU, a pure-JAX reference and the wrapper that picks one.

May import: jax only.
"""
