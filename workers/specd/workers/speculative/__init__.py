"""Speculative decoding: the draft loop and tree, verify, adaptive steps, the per-step
decoder and its CUDA graphs."""
