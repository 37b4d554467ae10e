"""Scheduling: continuous batching, admission, retraction, policies, streaming sessions'
KV and the bonus-slot accounting of speculative steps."""
