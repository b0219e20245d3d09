"""Triton kernels behind kiln's op implementations and forward transforms.

One kernel family per module, each with a plain-PyTorch reference beside it (Liger-Kernel's
layout): the tests compare kernel and reference over odd shapes with per-dtype tolerances, on CPU
through Triton's interpreter (``TRITON_INTERPRET=1``, small shapes) and on CUDA under the ``gpu``
marker. Importing this package never imports Triton; :mod:`kiln.ops.kernels.runtime` says whether
the kernels can run here.
"""
