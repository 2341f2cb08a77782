"""`python -m arpo_async.evaluate` forwards to `python -m arpo_async.jobs.evaluate`."""

if __name__ == "__main__":
    import runpy

    runpy.run_module("arpo_async.jobs.evaluate", run_name="__main__", alter_sys=True)
