"""Hot loops: hashing (fmix64), hash-index operations, row initialisation and optimizer updates,
each compiled with numba for the CPU and mirrored by a vectorised torch reference."""
