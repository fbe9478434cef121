"""The fx graph and what every stage knows about it: per-node facts (``meta``), the code a
graph runs (``codegen``, the run-time helpers in ``runtime``), module attribute paths
(``modules``), input shapes and their guard (``shapes``), the GraphModule a dynamo capture
returns (``graphmodule``) and the table of dtypes (``dtypes``).

The ground floor: modules here import nothing of amprewrite but ``amprewrite.errors`` and
``amprewrite.progress`` and each other.
"""
