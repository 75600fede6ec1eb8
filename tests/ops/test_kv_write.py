import pytest
import torch

from krait.ops.kv_write import write_kv, write_kv_ref, write_kv_triton


def make_case(num_tokens, num_heads, head_dim, block_size, num_blocks, seed=0):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, num_heads, head_dim, generator=g)  # [T, Hkv, D]
    value = torch.randn(num_tokens, num_heads, head_dim, generator=g)
    shape = (num_blocks, block_size, num_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::3] = -1
    return key, value, k_cache, v_cache, slots


def naive_write(key, value, k_cache, v_cache, slots):
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_cache[slot // block_size, slot % block_size] = key[t]
            v_cache[slot // block_size, slot % block_size] = value[t]
    return k_cache, v_cache


@pytest.mark.parametrize("block_size", [1, 16])
def test_reference_matches_naive(block_size):
    key, value, k_cache, v_cache, slots = make_case(20, 2, 8, block_size, 64 // block_size + 2)
    expected = naive_write(key, value, k_cache, v_cache, slots)
    write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected[0]) and torch.equal(v_cache, expected[1])


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_triton_matches_reference(block_size):
    key, value, k_cache, v_cache, slots = make_case(24, 3, 40, block_size, 96 // block_size + 1)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_ref(key, value, k_ref, v_ref, slots)
    write_kv_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_triton_strided_inputs():
    """key/value as views of a packed qkv projection."""
    key, value, k_cache, v_cache, slots = make_case(10, 2, 16, 16, 2, seed=1)
    qkv = torch.cat([torch.randn(10, 64), key.flatten(1), value.flatten(1)], dim=1)
    k_view, v_view = qkv[:, 64:96].view(10, 2, 16), qkv[:, 96:].view(10, 2, 16)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_ref(key, value, k_ref, v_ref, slots)
    write_kv_triton(k_view, v_view, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_triton_matches_reference_real_sizes():
    key, value, k_cache, v_cache, slots = make_case(4096, 8, 128, 16, 1024)
    args = [t.cuda() for t in (key, value)] + [t.cuda().bfloat16() for t in (k_cache, v_cache)]
    k_ref, v_ref = args[2].clone(), args[3].clone()
    write_kv_ref(args[0], args[1], k_ref, v_ref, slots.cuda())
    write_kv(*args, slots.cuda())
    assert torch.equal(args[2], k_ref) and torch.equal(args[3], v_ref)
