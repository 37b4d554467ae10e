"""Test doubles for the one part that cannot run here: the Kubernetes API server."""
