import os

# Triton reads this when a kernel is decorated, so it must be set before krait.ops is imported.
if not os.environ.get("KRAIT_TEST_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
