"""retouch.kernels: Triton kernels and, beside each, its pure-PyTorch reference (the CPU fallback and
the test oracle). Imported as `retouch.kernels`; the folder is mapped into the package by setup.py.
"""
