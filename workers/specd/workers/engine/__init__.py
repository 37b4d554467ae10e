"""The engine: one model replica's loop (scheduler + KV + model runner + metrics)."""
