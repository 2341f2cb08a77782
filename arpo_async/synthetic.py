"""`python -m arpo_async.synthetic` forwards to `python -m arpo_async.jobs.synthetic`."""

if __name__ == "__main__":
    import runpy

    runpy.run_module("arpo_async.jobs.synthetic", run_name="__main__", alter_sys=True)
