"""`python -m arpo_async.plots` forwards to `python -m arpo_async.jobs.plots`."""

if __name__ == "__main__":
    import runpy

    runpy.run_module("arpo_async.jobs.plots", run_name="__main__", alter_sys=True)
