"""The benchmarks (`arbiter bench ...`): every figure a ratio against a baseline of the same run.

Measurement code lives here, not in the product: ``floor`` decodes on the engine's own context for
the llama_decode floor. Only the CLI imports this package.
"""
