"""titan-core plugin: per-step fault tolerance across replica groups, and LocalSGD/DiLoCo, on torchft."""

import os

# torchft's Rust side (the manager, the lighthouse) logs every quorum and commit at INFO to stderr, read when the
# first of them starts: only its warnings help a user. Set here, before any module of this package imports torchft.
os.environ.setdefault("RUST_LOG", "warn")
