"""VMM drivers behind one async interface (`driver.py`): qemu (microvm, KVM or TCG), firecracker."""
