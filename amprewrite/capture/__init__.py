"""From a model to a graph, and the check against it: ``trace`` (``torch.fx.symbolic_trace``,
dynamo, non-strict ``torch.export``), ``dynamo_state`` (what a capture must set up and release
in dynamo's and transformers' process-wide state), ``exported`` (an ``ExportedProgram`` in and
out) and ``verify`` (the run against fp32 and autocast).

Imports ``amprewrite.graph`` and ``amprewrite.precision``, nothing above.
"""
