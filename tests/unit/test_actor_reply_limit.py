"""An actor's control client accepts a weights reply as large as its model
(actors/main.py ``reply_limit``): full copies come whole over ZeroMQ, and a model larger
than ``transport.max_message_mb`` (256 MiB by default: a 67M-parameter model in float32)
would otherwise be refused as ``too_large`` at every update."""

from __future__ import annotations


def test_an_actor_accepts_a_full_copy_of_its_model_whatever_the_message_limit(monkeypatch):
    from types import SimpleNamespace

    import actors.engines.base as base
    from actors.main import reply_limit

    cfg = SimpleNamespace(transport=SimpleNamespace(max_message_mb=256.0),
                          model=SimpleNamespace(path="/nowhere"))
    monkeypatch.setattr(base, "checkpoint_shapes", lambda path: None)
    assert reply_limit(cfg) == 256 * 2**20  # a hub name: the configured limit
    # Qwen2.5-0.5B's largest shapes: 494M values, 1.98 GB in float32
    monkeypatch.setattr(base, "checkpoint_shapes",
                        lambda path: {"embed": (151936, 896), "layers": (358_000_000,)})
    assert reply_limit(cfg) > (151936 * 896 + 358_000_000) * 4 > 256 * 2**20
