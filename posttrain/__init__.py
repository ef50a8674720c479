"""posttrain: a reproducible, versioned pipeline for LLM reasoning post-training."""

__version__ = "0.1.0"
