"""Probes and listings (``health``, ``ready``, ``v1/models``, ``metrics``)."""
