"""Client library of ddtree-serve: gRPC stubs wrapper, CLI and load test. Imports no torch."""
