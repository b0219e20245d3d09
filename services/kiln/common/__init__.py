"""Shared service runtime: settings, errors, logging, metrics, team identity, gRPC server."""
