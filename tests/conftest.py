"""Shared test setup: float32 everywhere, and a helper to run code under N simulated devices."""
import os

# Tests compare against float32 references; keep x64 off (the JAX default) explicitly.
os.environ.setdefault("JAX_ENABLE_X64", "0")
