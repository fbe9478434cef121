"""What each op may run in, and why: the op registry (``ops``), targets and kernel probes
(``target``, ``kernels``, ``coverage``), the options of a transform (``policy``), value ranges
(``ranges``), float8 (``float8``), the cast plan's min-cut (``cast_plan``) and the decisions a
transform reports (``report``).

Imports ``amprewrite.graph`` and nothing above it.
"""
