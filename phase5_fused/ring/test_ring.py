"""Ring attention: the sharding, the exact merge, and the whole ring (forward and gradients) against
utils.reference in float64 — on CPU with the gloo backend and several processes (what CI runs), on
GPUs with NCCL."""

from __future__ import annotations

import math

import pytest
import torch
import torch.multiprocessing as mp

from phase5_fused.ring import merge, ring_attention, shard, unshard
from phase5_fused.ring.ring_cases import spawned_worker
from phase5_fused.ring.sharding import padded_length
from utils import reference
from utils.testing import assert_close, new_seed, randn, requires_gpu


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("S", [1, 5, 24])
def test_shard_then_unshard_gives_the_sequence_back(world, is_causal, S):
    x = randn(2, 3, S, 4, device="cpu")
    shards = [shard(x, r, world, is_causal) for r in range(world)]
    assert all(s.shape[2] * world == padded_length(S, world, is_causal) for s in shards)
    assert torch.equal(unshard(shards, S, is_causal), x)


def test_causal_shards_are_zigzag_so_every_rank_holds_an_early_and_a_late_chunk():
    x = torch.arange(8.0).view(1, 1, 8, 1)
    assert shard(x, 0, 2, True).flatten().tolist() == [0, 1, 6, 7]
    assert shard(x, 1, 2, True).flatten().tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("is_causal", [False, True])
def test_merging_two_key_blocks_by_logsumexp_is_exact(is_causal):
    q, k, v = (randn(2, 2, 9, 8, dtype=torch.float64, device="cpu") for _ in range(3))
    ref, ref_lse = reference.attention(q, k, v, is_causal=is_causal, return_lse=True)
    cut = 4
    bias = reference.attention_bias(2, 2, 9, 9, is_causal=is_causal)
    first = reference.attention(q, k[:, :, :cut], v[:, :, :cut], mask=bias[..., :cut], return_lse=True)
    second = reference.attention(q, k[:, :, cut:], v[:, :, cut:], mask=bias[..., cut:], return_lse=True)
    out, lse = merge(*first, *second)
    assert_close(out, ref, dtype=torch.float64, what="merged output")
    assert_close(lse, ref_lse, dtype=torch.float64, what="merged logsumexp")


def test_merge_keeps_rows_that_see_no_key_at_zero():
    o = torch.zeros(1, 1, 2, 3)
    lse = torch.full((1, 1, 2), -math.inf)
    o_b = torch.ones(1, 1, 2, 3)
    lse_b = torch.tensor([[[-math.inf, 0.5]]])
    out, out_lse = merge(o, lse, o_b, lse_b)
    assert torch.equal(out[0, 0, 0], torch.zeros(3)) and out_lse[0, 0, 0] == -math.inf
    assert torch.equal(out[0, 0, 1], torch.ones(3)) and out_lse[0, 0, 1] == 0.5


def test_one_process_without_a_group_is_plain_attention():
    q, k, v = (randn(1, 2, 7, 8, dtype=torch.float64, device="cpu") for _ in range(3))
    out = ring_attention(*(shard(x, 0, 1, True) for x in (q, k, v)), seq_len=7, is_causal=True)
    assert_close(unshard([out], 7, True), reference.attention(q, k, v, is_causal=True), dtype=torch.float64)


@pytest.mark.parametrize("bad, message", [
    (dict(k=torch.zeros(1, 2, 6, 8)), "one shape"),
    (dict(v=torch.zeros(1, 2, 7, 8, dtype=torch.float64)), "share a dtype"),
    (dict(seq_len=30), "seq_len 30"),
    (dict(seq_len=0), "seq_len 0"),
    (dict(q=torch.zeros(2, 7, 8)), "q"),
])
def test_bad_inputs_are_refused_with_the_argument_named(bad, message):
    args = dict(q=torch.zeros(1, 2, 7, 8), k=torch.zeros(1, 2, 7, 8), v=torch.zeros(1, 2, 7, 8), seq_len=7)  # non-causal
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        ring_attention(**args)


def _spawn(world: int, backend: str, blocks: list[str], dtypes: list[torch.dtype], tmp_path) -> None:
    mp.spawn(spawned_worker, args=(world, str(tmp_path / "store"), backend, blocks, dtypes, new_seed()),
             nprocs=world, join=True)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_matches_the_reference_on_cpu_processes(world, tmp_path):
    _spawn(world, "gloo", ["reference"], [torch.float64], tmp_path)


@requires_gpu
@pytest.mark.parametrize("world", [1, 2])
def test_ring_on_gpus_with_nccl_and_the_kernels(world, tmp_path):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, {torch.cuda.device_count()} visible")
    _spawn(world, "nccl", ["sdpa_flash", "course"], [torch.float16, torch.bfloat16], tmp_path)
