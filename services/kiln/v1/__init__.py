"""Generated gRPC code for package kiln.v1 (python -m kiln.protogen)."""
