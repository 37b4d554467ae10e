"""KV memory: sizing rules, request rows (req_to_token), the paged token allocator,
per-request KV bookkeeping and the per-layer K/V buffers."""
