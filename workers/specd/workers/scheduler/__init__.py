"""Scheduling: requests, the per-step batch description and the continuous-batching policy."""
