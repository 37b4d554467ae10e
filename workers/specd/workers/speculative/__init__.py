"""Speculative decoding as pure tensor functions: draft trees (``tree``) and verify (``verify``)."""
