"""C kernels for the CPU hot paths, compiled with the machine's C compiler on first use (see build.py) and called
through ctypes. Every caller keeps a pure-torch path for machines without a compiler, other dtypes and GPUs."""
