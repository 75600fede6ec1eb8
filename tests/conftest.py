import os

# Triton reads this when a kernel is decorated, so it must be set before krait.ops is imported.
if not os.environ.get("KRAIT_TEST_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tiny models: one thread is faster, and two threads stall each other on a shared 2-core box.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """arch -> the directory of its tiny random hybrid checkpoint (tests/utils.ARCHS), saved once
    per arch and test module."""
    from tests.utils import make_tiny_hybrid, require_arch

    cache: dict[str, str] = {}

    def get(arch: str) -> str:
        require_arch(arch)
        if arch not in cache:
            cache[arch] = make_tiny_hybrid(tmp_path_factory.mktemp(arch), arch)
        return cache[arch]

    return get
