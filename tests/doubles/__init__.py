"""In-process doubles of the VMM driver and the network slots (see driver.py), and a node
assembled on them (node.py), for fast tests of the orchestrator and the API."""
