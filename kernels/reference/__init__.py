"""Plain torch twins of the Triton kernels in kernels/triton/: the correctness oracles the
tests compare against, written for clarity rather than speed."""
