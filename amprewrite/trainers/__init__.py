"""Integrations with training frameworks: the switch that puts amprewrite's plan and its loss
scaler where each framework trains: transformers' ``Trainer`` (``transformers``), accelerate's
``Accelerator`` (``accelerate``), a Lightning precision plugin (``lightning``). Each imports its
framework only when it is used; ``import amprewrite`` imports none of them. Their inner compiler
by default fits the device (``inner="auto"``, :mod:`amprewrite.trainers.inner`: eager on a CPU,
inductor elsewhere).

Imports ``amprewrite.compile`` and the stages below it; nothing of ``deploy``, ``show`` or the
command line.
"""
