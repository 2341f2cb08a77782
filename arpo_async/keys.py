"""`python -m arpo_async.keys` forwards to `python -m arpo_async.core.keys`."""

if __name__ == "__main__":
    import runpy

    runpy.run_module("arpo_async.core.keys", run_name="__main__", alter_sys=True)
