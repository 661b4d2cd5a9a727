"""Integration tests of the QEMU driver with real VMs (TCG here)."""
