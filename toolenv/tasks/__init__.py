"""What the agent is asked and how it is scored: prompt sources (prompts.py), data-file
loaders (data.py), the synthetic tool suite's generator (suite.py) and rewards
(rewards.py). Used by the actors and by evaluation."""
