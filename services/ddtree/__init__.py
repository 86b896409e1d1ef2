"""ddtree-serve: tree speculative decoding (DDTree + DFlash) served as gRPC microservices.

Importing this package is cheap (no torch): subpackages load what they need.
"""
from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("ddtree-serve")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
