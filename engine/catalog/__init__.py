"""Which models exist on this machine and by which names."""
