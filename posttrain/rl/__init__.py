"""The RL loop as a package, walked top-down by ``stages/rl.py``: ``select`` (which prompts, in which order,
with which priors) -> ``collect`` (one step's rollout -> reward) -> ``update`` (advantages -> policy update) ->
``shards`` (the step persisted)."""
