"""Build script. The package itself is pure Python (metadata in pyproject.toml).

The optional compiled extension (csrc/) is added here by the extension build;
a plain `pip install -e .` never needs a compiler or CUDA.
"""
from setuptools import setup

setup()
