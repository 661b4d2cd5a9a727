"""`aenv gateway`: the E2B control plane and data-plane proxy in front of a cluster's nodes.

Stateless: it finds sandboxes and nodes in the cluster's Redis (`aenv.cluster.directory`), places
creates (`aenv.cluster.placement`) and forwards everything else to the node a sandbox lives on,
through the node's internal API (`aenv.cluster.internal`). Any number can run side by side.
"""
