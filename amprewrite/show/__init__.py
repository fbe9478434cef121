"""What people read: graph views (``views``), their text and SVG rendering (``render``), the
HTML report (``html``), Google's Model Explorer (``explorer``) and the numerics tables
(``numerics``: per-node error against fp32).

Imports every stage below it and ``amprewrite.api``; nothing of ``compile``, ``deploy`` or the
command line.
"""
