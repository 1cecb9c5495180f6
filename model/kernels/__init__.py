"""Optional compute kernels (Triton); each module imports its backend lazily."""
