"""The words that callers of smf_kernels pass as strings, each declared once here, in a module that imports nothing
(no torch): the library checks its arguments against them, and the smf command line's parser offers them as choices
without loading torch (``smf --help``; :mod:`smf.vocabulary` reads them from here)."""
from __future__ import annotations

RULES = ("tfidf", "kl")  # the slot scoring rules (:mod:`smf_kernels.sparse.selection`)
BACKENDS = ("torch", "triton", "ext")  # the kernel backends (:mod:`smf_kernels.backends`)
