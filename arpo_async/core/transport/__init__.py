"""ZeroMQ between actors and the learner, one module per channel.

- ``trajectory``: the trajectory channel, actors' PUSH -> the learner's PULL, with
  high-water marks on both ends so that a slow learner blocks the actors (backpressure).
- ``control``: the control channel, actors' DEALER <-> the learner's ROUTER (Hello,
  heartbeats, tickets, Bye, config, and the requests of the weight channels, each of
  which holds its messages and both sides in one module: arpo_async/core/weights/).
- ``sockets``: what the channels share: bound server sockets with CurveZMQ, client
  sockets with ZMTP heartbeats, the counter of rejected input.

Malformed input never raises in the learner: it is counted by its ProtocolError reason.
DEALER and PUSH reconnect by themselves when a learner restarts on the same port.
"""
