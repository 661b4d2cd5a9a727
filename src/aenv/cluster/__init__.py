"""Multi-node state on Redis (or Valkey): the node registry with leases, sandbox -> node routing,
which nodes hold which template and snapshot files, and the node agent that keeps them published.

Nodes are the source of truth (their catalogs); everything here can be rebuilt from them. See
docs/cluster.md for the key layout and the production notes.
"""
