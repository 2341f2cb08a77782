"""arpo_async: asynchronous ARPO/AEPO training of tool-using LLM agents.

The house, from the bottom up (docs/design.md has the whole picture):

    arpo_async/core/      shared by every process: config, protocol, transport, keys,
                          staleness, metrics, files, run folder, host, entropy math
    toolenv/              the tools (Python sandbox, search, cache) and the tasks
                          (prompts, data loaders, rewards)
    actors/               an actor process: engines, rollouts, branching, weight receiver
    learner/              the learner process: losses, batching, DeepSpeed, service, ledger
    arpo_async/launcher/  starts, watches and restarts the role processes
    arpo_async/jobs/      the jobs around RL: suite, tiny model, SFT, evaluation, pipeline,
                          experiments, plots
    arpo_async/launch.py  ``python -m arpo_async.launch`` (``arpo-launch``), the entry point
"""
