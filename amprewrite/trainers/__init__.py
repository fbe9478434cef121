"""Integrations with training frameworks: the switch that puts amprewrite's plan and its loss
scaler where each framework trains: transformers' ``Trainer`` (``transformers``), accelerate's
``Accelerator`` (``accelerate``), a Lightning precision plugin (``lightning``). Each imports its
framework only when it is used; ``import amprewrite`` imports none of them.

Imports ``amprewrite.compile`` and the stages below it; nothing of ``deploy``, ``show`` or the
command line.
"""
