import os

# Triton reads this when a kernel is decorated, so it must be set before krait.ops is imported.
if not os.environ.get("KRAIT_TEST_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tiny models: one thread is faster, and two threads stall each other on a shared 2-core box.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
