"""The core every process imports: config, the wire protocol and its transport, keys,
staleness and admission, metrics, durable files, the run folder's layout, host identity
and the entropy math. It imports no role (actors, learner, toolenv), no launcher and no
job (tests/unit/test_layers.py enforces it)."""
