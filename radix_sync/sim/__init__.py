"""Trace-driven cluster simulator: N SGLang-like workers, their radix caches and links, driven by real traces or
generators, pitting the policies of `radix_sync.policy` against each other. Entry point: `radix_sync.sim.cli`."""
