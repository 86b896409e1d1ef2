"""Generated gRPC/protobuf stubs of proto/ddtree/v1 (made by tools/gen_proto.py; never edit)."""
