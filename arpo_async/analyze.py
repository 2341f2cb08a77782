"""`python -m arpo_async.analyze` forwards to `python -m arpo_async.jobs.analyze`."""

if __name__ == "__main__":
    import runpy

    runpy.run_module("arpo_async.jobs.analyze", run_name="__main__", alter_sys=True)
