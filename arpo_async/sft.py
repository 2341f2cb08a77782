"""`python -m arpo_async.sft` forwards to `python -m arpo_async.jobs.sft`."""

if __name__ == "__main__":
    import runpy

    runpy.run_module("arpo_async.jobs.sft", run_name="__main__", alter_sys=True)
