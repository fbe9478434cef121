"""What the tests and the benchmarks share: real models from small configs
(:mod:`amprewrite.testing.zoo`, needs ``transformers`` and ``diffusers``) and the conformance
check (:mod:`amprewrite.testing.conformance`). Tests assert on its results; benchmarks print them.

The top layer: it may import every part of the package, and nothing in the package imports it.
"""
