"""A request's state and the batch description handed between scheduler and runner:
`Req`, `ScheduledBatch` / `RunnerOutput`, stop rules and per-request faults."""
