"""The launcher behind ``python -m arpo_async.launch``: the process plan (plan.py), the
supervisor that starts, watches and restarts the roles (supervisor.py), the live panel
(progress.py) and actors on other machines (remote.py). It starts roles as processes and
imports none of their modules, only the core."""
