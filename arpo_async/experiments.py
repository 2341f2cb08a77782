"""`python -m arpo_async.experiments` forwards to `python -m arpo_async.jobs.experiments`."""

if __name__ == "__main__":
    import runpy

    runpy.run_module("arpo_async.jobs.experiments", run_name="__main__", alter_sys=True)
