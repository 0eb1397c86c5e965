"""CPU kernels (torch ops and numba), each with a plain torch reference twin."""
