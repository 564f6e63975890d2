"""Generated protobuf and gRPC code (scripts/gen_protos.sh from proto/). Never edit by hand."""
