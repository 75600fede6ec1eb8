import os

# Triton reads this when a kernel is decorated, so it must be set before krait.ops is imported.
if not os.environ.get("KRAIT_TEST_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tiny models: one thread is faster, and two threads stall each other on a shared 2-core box.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _patch_triton_lang_once_a_launch() -> None:
    """Triton 3.8's interpreter re-patches triton.language (an inspect.getmembers walk of
    tl, tl.core, tl.math and tl.tensor) on every call of a @triton.jit helper inside a kernel,
    though the launch has already patched those modules: a third or more of an interpreted
    model step. Skip the repeat while a launch's patch is in place (only when the helper's
    module sees no language module that the launch did not patch); the kernels run the same.
    KRAIT_TEST_INTERPRETER_REPATCH=1 keeps Triton's own behaviour."""
    if (os.environ.get("TRITON_INTERPRET") != "1"
            or os.environ.get("KRAIT_TEST_INTERPRETER_REPATCH")):
        return
    import inspect

    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    if triton.__version__ != "3.8.0" or not hasattr(interpreter, "_patch_lang"):
        return  # written against 3.8.0's interpreter; any other keeps its own
    patch_lang, grid_call = interpreter._patch_lang, interpreter.GridExecutor.__call__
    langs_of: dict = {}
    patched: list = []  # a launch's patched language modules (ids), innermost last

    def langs(fn) -> frozenset:
        key = id(fn)
        if key not in langs_of:
            langs_of[key] = (fn, frozenset(id(v) for v in fn.__globals__.values()
                                           if inspect.ismodule(v) and v in (tl, tl.core)))
        return langs_of[key][1]

    def launch(self, *args, **kwargs):
        patched.append(None)  # the launch's own _patch_lang call fills it
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched.pop()

    def patch_once(fn):
        if patched:
            need = langs(fn)
            if patched[-1] is not None and need <= patched[-1]:
                return None  # a helper's call: Triton discards the scope it would return
            patched[-1] = need | (patched[-1] or frozenset())
        return patch_lang(fn)

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch


_patch_triton_lang_once_a_launch()


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
