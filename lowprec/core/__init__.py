"""The core: number formats, rounding, granularity, scales, scalers, casts, ``ScaledTensor``.

``core`` knows nothing of modules or training; every technique (``amp``, ``unit``,
``float8``, ``scalify``) builds on it and none imports another.

Inside the core, imports point one way too (no module imports another inside a function
to dodge a cycle): ``formats``, ``granularity``, ``registry`` and ``warn`` at the bottom;
``bits`` (the bit arithmetic kernels trace) and ``layout`` (the fast paths' switch and
views) on them; ``kernels`` (compiled eager kernels) on those; ``rounding`` (``quantize``,
``to_format``) on the kernels; ``codes``, ``casts`` and ``scales`` on rounding; then
``scalers``, ``tensor`` and ``tensor_ops``.
"""
