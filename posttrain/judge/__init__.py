"""The LLM judge behind the ``llm_judge`` reward: an OpenAI-compatible server asked to grade completions.

- ``verdict``: the prompt template, the verdict formats (``VERDICTS``) and their strict parsers.
- ``cache``: the judge-call cache (a DVC-tracked JSONL file; per-process shards merged by the stage).
- ``client``: batched requests (``openai`` client: timeouts, retries with backoff; a thread pool for concurrency).
- ``server``: ``vllm serve`` of a local folder on a free port, health wait, process-tree stop.
- ``session``: the judge for a stage's length (server, environment for scoring processes, cache merge).

The reward itself is ``posttrain.rewards.judge.llm_judge``. See docs/judge.md.
"""
