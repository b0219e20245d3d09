"""Workloads: model architectures from Hugging Face configs, and traffic shapes from traces.

Importable without the service dependencies (no gRPC, NATS or SQLAlchemy at import time).
"""
