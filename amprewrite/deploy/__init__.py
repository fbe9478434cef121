"""Shipping a transformed model: ``export`` (torch.export, AOTInductor and ONNX files, each
loaded back and checked), ``onnx_lean`` and ``onnx_rounded`` (ONNX files without needless casts,
and run with every declared fp16 value rounded) and ``portable`` (programs that load anywhere).

Imports the stages below it and ``amprewrite.api``; nothing of ``compile``, ``show`` or the
command line.
"""
