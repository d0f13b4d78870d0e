"""verl's Megatron engine on this project: the CPU runtime (``cpu_patches``, ``cpu_device``, ``cpu_spec``).

Everything here imports megatron lazily, so importing the package costs nothing on a machine without it.
"""
