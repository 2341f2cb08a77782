"""The jobs around RL, each a command: the synthetic suite (synthetic.py), the tiny local
model (tiny_model.py), cold-start SFT (sft.py), evaluation (evaluate.py), the default
job's stages (pipeline.py), throughput experiments (experiments.py) and plots (plots.py).
Jobs may use every layer below them: the core, the roles and the launcher."""
