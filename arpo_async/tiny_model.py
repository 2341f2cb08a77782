"""`python -m arpo_async.tiny_model` forwards to `python -m arpo_async.jobs.tiny_model`."""

if __name__ == "__main__":
    import runpy

    runpy.run_module("arpo_async.jobs.tiny_model", run_name="__main__", alter_sys=True)
