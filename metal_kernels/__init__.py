"""Metal kernels for the MLX backend, built with ``mx.fast.metal_kernel`` (installed as
``swiftlm.metal_kernels``).

Each kernel has a pure-MLX reference with the same contract.  Metal cannot run on the Linux
machines this project is tested on, so a kernel checks itself against its reference on first use on
a Metal device and, if it fails to build or disagrees, logs a warning and the reference is used.
"""
