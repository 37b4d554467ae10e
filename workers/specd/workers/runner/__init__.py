"""Running one batch: tensors in, model forward, logits processed and sampled (model and
graph runners, sampling, logits processors, logprobs, structured output, thinking gate)."""
