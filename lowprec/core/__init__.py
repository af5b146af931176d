"""The core: number formats, rounding, granularity, scales, scalers, casts, ``ScaledTensor``.

``core`` knows nothing of modules or training; every technique (``amp``, ``unit``,
``float8``, ``scalify``) builds on it and none imports another.
"""
