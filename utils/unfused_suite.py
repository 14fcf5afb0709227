"""The correctness suite every three-kernel phase (2-4) passes: matmul_qk, softmax, matmul_av and
their composition against float64 references (utils.reference), and bad inputs.

A phase's test file subclasses UnfusedSuite and names its package; pytest collects the subclass:

    import phase3_tiled as ph
    from utils.unfused_suite import UnfusedSuite

    class TestTiled(UnfusedSuite):
        phase = ph                                           # matmul_qk, softmax, matmul_av, attention, load
        variants = {f"t{t}": {"tile": t} for t in ph.TILES}  # keyword arguments of the matmuls and attention
        op_args = {"matmul_qk": (16,), "matmul_av": (16,), "attention": (16,)}  # trailing torch.ops arguments

Tests that take `variant` run once per variant; the others use the phase's defaults. Every check
uses fresh random inputs, and the outputs of the API calls are NaN-poisoned (utils.testing).
"""

from __future__ import annotations

import math

import pytest
import torch

from utils import reference
from utils.testing import (UNFUSED_SHAPES, assert_close, poison_, poisoned_call, random_additive_mask,
                           random_bool_mask, random_qkv, randn, rel_error, requires_gpu, shape_ids)
from utils.unfused_api import MAX_HEAD_DIM

SHAPES = UNFUSED_SHAPES
HEAD_DIMS = sorted({shape[4] for shape in SHAPES})                            # the head dims checked
SEQ_LENS = sorted({shape[2] for shape in SHAPES} | {shape[3] for shape in SHAPES})   # the lengths checked
MASKINGS = ["none", "causal", "bool", "additive", "causal+bool"]


def masking_mask(kind: str, B, H, Sq, Sk):
    """The mask of a masking kind: a bool mask broadcast over heads, or an additive one over batch
    and heads; None for none and causal alone."""
    if kind.endswith("bool"):
        return random_bool_mask((B, 1, Sq, Sk))
    if kind == "additive":
        return random_additive_mask((Sq, Sk))
    return None


class UnfusedSuite:
    phase = None                        # the phase package
    variants: dict[str, dict] = {}      # name -> keyword arguments; empty: the defaults only
    op_args: dict[str, tuple] = {}      # op name -> trailing arguments of its torch.ops call

    def pytest_generate_tests(self, metafunc):
        if "variant" in metafunc.fixturenames and len(self.variants) > 1:
            metafunc.parametrize("variant", list(self.variants.values()), ids=list(self.variants))

    @pytest.fixture
    def variant(self) -> dict:
        """The phase's one variant: its defaults."""
        return next(iter(self.variants.values()), {})

    def long_sequence(self, variant: dict) -> int:
        """A query length whose row tiles pass the 65535 grid-y limit of the phase's kernels."""
        return 600_001

    def ops(self, name: str, *args):
        """torch.ops.<phase>.<name>(*args, *op_args[name]): the C++ op behind the Python checks."""
        return getattr(self.phase.load(), name)(*args, *self.op_args.get(name, ()))

    # --------------------------------------------------------------------------------------------
    # Each kernel on its own

    @requires_gpu
    @pytest.mark.parametrize("shape", SHAPES, ids=shape_ids(SHAPES))
    def test_matmul_qk(self, shape, variant):
        B, H, Sq, Sk, D = shape
        q, k, _ = random_qkv(B, H, Sq, Sk, D)
        scale = 0.37
        s = poisoned_call(lambda: self.phase.matmul_qk(q, k, scale=scale, **variant), (B, H, Sq, Sk))
        ref = scale * (q.double() @ k.double().transpose(-1, -2))
        magnitude = scale * (q.double().abs() @ k.double().abs().transpose(-1, -2))
        assert_close(s, ref, what="matmul_qk", ref_scale=magnitude)
        # Default scale 1/sqrt(D).
        assert_close(self.phase.matmul_qk(q, k, **variant), ref / scale / math.sqrt(D), what="matmul_qk default scale",
                     ref_scale=magnitude / scale / math.sqrt(D))

    @requires_gpu
    @pytest.mark.parametrize("shape", SHAPES, ids=shape_ids(SHAPES))
    @pytest.mark.parametrize("masking", MASKINGS)
    def test_softmax(self, shape, masking):
        B, H, Sq, Sk, _ = shape
        s = randn(B, H, Sq, Sk, scale=3.0)
        mask = masking_mask(masking, B, H, Sq, Sk)
        causal = masking.startswith("causal")
        p = poisoned_call(lambda: self.phase.softmax(s, mask=mask, is_causal=causal), (B, H, Sq, Sk))
        bias = reference.attention_bias(B, H, Sq, Sk, mask, causal, device=s.device)
        assert_close(p, reference.softmax(s.double() + bias), what=f"softmax ({masking})")

    @requires_gpu
    @pytest.mark.parametrize("shape", SHAPES, ids=shape_ids(SHAPES))
    def test_matmul_av(self, shape, variant):
        B, H, Sq, Sk, D = shape
        p = torch.softmax(randn(B, H, Sq, Sk, scale=2.0), dim=-1)
        v = randn(B, H, Sk, D)
        o = poisoned_call(lambda: self.phase.matmul_av(p, v, **variant), (B, H, Sq, D))
        assert_close(o, p.double() @ v.double(), what="matmul_av", ref_scale=p.double().abs() @ v.double().abs())

    @requires_gpu
    def test_kernels_compose_like_attention(self):
        q, k, v = random_qkv(2, 2, 130, 257, 64)
        mask = random_bool_mask((130, 257))
        out = self.phase.matmul_av(self.phase.softmax(self.phase.matmul_qk(q, k), mask=mask), v)
        assert_close(out, reference.attention(q, k, v, mask=mask))

    # --------------------------------------------------------------------------------------------
    # The composition

    @requires_gpu
    @pytest.mark.parametrize("shape", SHAPES, ids=shape_ids(SHAPES))
    @pytest.mark.parametrize("masking", MASKINGS)
    def test_attention(self, shape, masking, variant):
        B, H, Sq, Sk, D = shape
        q, k, v = random_qkv(B, H, Sq, Sk, D)
        mask = masking_mask(masking, B, H, Sq, Sk)
        causal = masking.startswith("causal")
        out = poisoned_call(lambda: self.phase.attention(q, k, v, mask=mask, is_causal=causal, **variant),
                            (B, H, Sq, Sk), (B, H, Sq, D))
        ref = reference.attention(q, k, v, mask=mask, is_causal=causal)
        assert_close(out, ref, what=f"attention ({masking}, {variant})")

    @requires_gpu
    @pytest.mark.parametrize("mask_shape", ["full", "query_key", "batch_broadcast", "key_only"])
    @pytest.mark.parametrize("kind", ["bool", "additive"])
    @pytest.mark.parametrize("causal", [False, True])
    def test_attention_masks(self, mask_shape, kind, causal):
        B, H, Sq, Sk, D = 2, 3, 127, 200, 64
        shape = {"full": (B, H, Sq, Sk), "query_key": (Sq, Sk), "batch_broadcast": (1, H, Sq, Sk),
                 "key_only": (B, 1, 1, Sk)}[mask_shape]
        mask = random_bool_mask(shape) if kind == "bool" else random_additive_mask(shape)
        q, k, v = random_qkv(B, H, Sq, Sk, D)
        assert_close(self.phase.attention(q, k, v, mask=mask, is_causal=causal),
                     reference.attention(q, k, v, mask=mask, is_causal=causal), what=f"{kind} mask {shape}")

    @requires_gpu
    def test_attention_scale_mask_shapes_and_noncontiguous(self):
        B, H, Sq, Sk, D = 2, 3, 33, 45, 64
        q, k, v = random_qkv(B, H, Sq, Sk, D)
        for mask in (random_bool_mask((Sk,)), random_additive_mask((1, H, 1, Sk)),
                     random_bool_mask((B, H, Sq, Sk)), random_additive_mask((B, 1, Sq, 1)).double()):
            out = self.phase.attention(q, k, v, mask=mask, scale=0.2)
            assert_close(out, reference.attention(q, k, v, mask=mask, scale=0.2), what=f"mask {tuple(mask.shape)}")
        # Non-contiguous q (a transposed view) is made contiguous by the API.
        qt = q.transpose(1, 2).contiguous().transpose(1, 2)
        assert not qt.is_contiguous()
        assert_close(self.phase.attention(qt, k, v), reference.attention(q, k, v), what="non-contiguous q")
        # So are q, k and v all seen as [B, H, S, D] through a [B, S, H, D] layout.
        q, k, v = (randn(2, 64, 3, 32).transpose(1, 2) for _ in range(3))
        assert not q.is_contiguous()
        assert_close(self.phase.attention(q, k, v), reference.attention(q, k, v), what="non-contiguous q, k, v")

    @requires_gpu
    @pytest.mark.parametrize("Sk", [17, 33, 128, 1000])
    def test_fully_masked_rows_give_zeros(self, Sk):
        B, H, Sq, D = 2, 2, 40, 64
        q, k, v = random_qkv(B, H, Sq, Sk, D)
        mask = random_bool_mask((B, H, Sq, Sk))
        mask[:, :, ::3] = False                      # every third query row sees nothing
        additive = torch.zeros(B, H, Sq, Sk, device="cuda").masked_fill(~mask, float("-inf"))
        for m in (mask, additive):
            out = self.phase.attention(q, k, v, mask=m)
            assert torch.equal(out[:, :, ::3], torch.zeros_like(out[:, :, ::3]))
            assert_close(out, reference.attention(q, k, v, mask=m), what="fully masked rows")
            p = self.phase.softmax(randn(B, H, Sq, Sk), mask=m)
            assert torch.equal(p[:, :, ::3], torch.zeros_like(p[:, :, ::3]))
        # A row hidden by an additive mask under causal masking too.
        additive = torch.zeros(B, H, Sq, Sk, device="cuda")
        additive[:, :, 1] = float("-inf")
        out = self.phase.attention(q, k, v, mask=additive, is_causal=True)
        assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
        assert_close(out, reference.attention(q, k, v, mask=additive, is_causal=True), what="causal, masked row")

    @requires_gpu
    def test_large_magnitude_inputs_never_nan(self, variant):
        # Softmax of huge scores: exact inputs, so the tolerance stays tight.
        s = randn(2, 2, 64, 300, scale=1e4)
        p = self.phase.softmax(s, is_causal=True)
        assert torch.isfinite(p).all()
        assert_close(p, reference.softmax(s.double() + reference.attention_bias(2, 2, 64, 300, is_causal=True,
                                                                                device=s.device)), what="softmax 1e4")
        # Attention on inputs 10x the usual size: scores about 100, rounding of q.k in FP32 grows
        # with |q||k|, so the bound is looser (the kernel is not the cause: cuBLAS does the same).
        q, k, v = random_qkv(2, 2, 100, 130, 64, scale=10.0)
        out = self.phase.attention(q, k, v, is_causal=True, **variant)
        assert torch.isfinite(out).all()
        assert rel_error(out, reference.attention(q, k, v, is_causal=True)) < 1e-3

    @requires_gpu
    def test_poisoning_reaches_the_outputs(self):
        """The harness itself: a buffer allocated right after poisoned_call() freed one of its size is NaN."""
        shape = (1, 2, 37, 29)
        assert torch.isnan(poisoned_call(lambda: torch.empty(shape, device="cuda"), shape)).all()

    @requires_gpu
    def test_outputs_are_fresh_buffers(self):
        """The ops allocate their outputs; poisoning an earlier result must not leak into the next."""
        q, k, v = random_qkv(1, 2, 64, 64, 64)
        poison_(self.phase.attention(q, k, v))
        assert_close(self.phase.attention(q, k, v), reference.attention(q, k, v))

    @requires_gpu
    def test_grid_limits_many_heads_and_long_sequences(self, variant):
        # B*H above the 65535 grid-z limit, and row tiles above the 65535 grid-y limit.
        q, k, v = random_qkv(1, 65537, 3, 2, 8)
        assert_close(self.phase.attention(q, k, v, **variant), reference.attention(q, k, v), what="B*H = 65537")
        Sq = self.long_sequence(variant)
        q, k, v = random_qkv(1, 1, Sq, 3, 8)
        assert_close(self.phase.attention(q, k, v, is_causal=True, **variant),
                     reference.attention(q, k, v, is_causal=True), what=f"Sq = {Sq}")

    @requires_gpu
    def test_score_buffer_past_2_pow_31_elements(self):
        B, H, S, D = 1, 2, 32_800, 32                 # B*H*S*S = 2.15e9 > 2^31
        if torch.cuda.mem_get_info()[0] < 12 * 2**30:
            pytest.skip("needs 12 GiB of free GPU memory")
        q, k, v = random_qkv(B, H, S, S, D)
        # The last rows of the last head live past element 2^31 of the score buffer.
        tail = reference.attention(q[:, :, -5:], k, v)
        for variant in self.variants.values() or [{}]:
            out = self.phase.attention(q, k, v, **variant)
            assert_close(out[:, :, -5:], tail, what=f"rows past 2^31 {variant}")
            del out
            torch.cuda.empty_cache()

    @requires_gpu
    def test_fake_implementations_give_shapes(self):
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.phase.load()
        with FakeTensorMode():
            q = torch.empty(2, 3, 5, 16, device="cuda")
            k = torch.empty(2, 3, 7, 16, device="cuda")
            assert self.ops("matmul_qk", q, k, 0.25).shape == (2, 3, 5, 7)
            assert self.ops("softmax", torch.empty(2, 3, 5, 7, device="cuda"), None, True).shape == (2, 3, 5, 7)
            assert self.ops("matmul_av", torch.empty(2, 3, 5, 7, device="cuda"), k).shape == (2, 3, 5, 16)
            assert self.ops("attention", q, k, k, None, False, 0.25).shape == (2, 3, 5, 16)

    # --------------------------------------------------------------------------------------------
    # Bad input: each error names the argument

    def test_cpu_tensors_are_rejected_naming_the_argument(self):
        q = torch.randn(1, 1, 4, 8)
        with pytest.raises(ValueError, match="q must be a CUDA tensor"):
            self.phase.attention(q, q, q)
        with pytest.raises(ValueError, match="q must be a CUDA tensor"):
            self.phase.matmul_qk(q, q)
        with pytest.raises(ValueError, match="s must be a CUDA tensor"):
            self.phase.softmax(q)
        with pytest.raises(ValueError, match="p must be a CUDA tensor"):
            self.phase.matmul_av(q, q)

    @requires_gpu
    @pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
    def test_wrong_dtype_is_rejected(self, dtype):
        q, k, v = random_qkv(1, 2, 8, 8, 16)
        with pytest.raises(TypeError, match="q must have dtype float32"):
            self.phase.attention(q.to(dtype), k.to(dtype), v.to(dtype))
        with pytest.raises(TypeError, match="q"):
            self.phase.attention(q.to(dtype), k, v)
        with pytest.raises(TypeError, match="k"):
            self.phase.attention(q, k.to(dtype), v)
        with pytest.raises(TypeError, match="k"):
            self.phase.matmul_qk(q, k.to(dtype))
        with pytest.raises(TypeError, match="s must have dtype float32"):
            self.phase.softmax(q.to(dtype))
        with pytest.raises(TypeError, match="p must have dtype float32"):
            self.phase.matmul_av(q.to(dtype), v)

    @requires_gpu
    def test_mismatched_shapes_are_rejected(self):
        q, k, v = random_qkv(2, 2, 8, 8, 32)
        with pytest.raises(ValueError, match="k must be"):
            self.phase.attention(q, k[..., :16].contiguous(), v)
        with pytest.raises(ValueError, match="k must be"):
            self.phase.attention(q, k[:1].contiguous(), v)
        with pytest.raises(ValueError, match="k must be"):
            self.phase.attention(q, k[:, :1].contiguous(), v)
        with pytest.raises(ValueError, match="v must have k's shape"):
            self.phase.attention(q, k, v[:, :, :4].contiguous())
        with pytest.raises(ValueError, match="q must be 4-D"):
            self.phase.attention(q[0], k, v)
        with pytest.raises(ValueError, match="k must be"):
            self.phase.matmul_qk(q, k[:, :1].contiguous())
        with pytest.raises(ValueError, match="k must be"):
            self.phase.matmul_qk(q, k[..., :8].contiguous())
        with pytest.raises(ValueError, match="s"):
            self.phase.softmax(randn(2, 8, 8))
        with pytest.raises(ValueError, match="v must be"):
            self.phase.matmul_av(randn(2, 2, 8, 8), randn(2, 2, 7, 32))

    @requires_gpu
    def test_wrong_mask_shape_is_rejected(self):
        q, k, v = random_qkv(2, 2, 8, 12, 16)
        with pytest.raises(ValueError, match="mask of shape"):
            self.phase.attention(q, k, v, mask=torch.ones(8, 8, dtype=torch.bool, device="cuda"))
        with pytest.raises(ValueError, match="mask"):
            self.phase.attention(q, k, v, mask=torch.ones(3, 12, dtype=torch.bool, device="cuda"))
        with pytest.raises(ValueError, match="mask of shape"):
            self.phase.softmax(randn(2, 2, 8, 12), mask=torch.ones(3, 1, 1, 12, dtype=torch.bool, device="cuda"))
        with pytest.raises(ValueError, match="mask"):
            self.phase.softmax(randn(1, 2, 8, 8), mask=torch.ones(2, 2, 8, 8, dtype=torch.bool, device="cuda"))

    @requires_gpu
    @pytest.mark.parametrize("D", [MAX_HEAD_DIM + 1, 2 * MAX_HEAD_DIM])
    def test_unsupported_head_dim_is_rejected(self, D):
        q, k, v = random_qkv(1, 1, 8, 8, D)
        with pytest.raises(ValueError, match=f"head dim D={D}"):
            self.phase.attention(q, k, v)
        with pytest.raises(ValueError, match=f"head dim D={D}"):
            self.phase.matmul_qk(q, k)
        with pytest.raises(ValueError, match=f"head dim D={D}"):
            self.phase.matmul_av(torch.rand(1, 1, 8, 8, device="cuda"), v)

    @requires_gpu
    def test_op_level_checks_name_the_argument(self):
        """The C++ ops check again (for callers that bypass the Python API)."""
        q, k, v = random_qkv(1, 2, 8, 8, 32)
        with pytest.raises(RuntimeError, match="k must have q's head dim"):
            self.ops("attention", q, k[..., :16].contiguous(), v[..., :16].contiguous(), None, False, 1.0)
        with pytest.raises(RuntimeError, match="k must be"):
            self.ops("matmul_qk", q, k[..., :8].contiguous(), 1.0)
        with pytest.raises(RuntimeError, match="v must be"):
            self.ops("matmul_av", randn(1, 2, 8, 8), randn(1, 2, 7, 32))
        with pytest.raises(RuntimeError, match=f"head dim D={MAX_HEAD_DIM + 72}"):
            self.ops("matmul_av", torch.rand(1, 1, 8, 8, device="cuda"),
                     torch.rand(1, 1, 8, MAX_HEAD_DIM + 72, device="cuda"))
        with pytest.raises(RuntimeError, match="s must be float32"):
            self.ops("softmax", q.double(), None, False)
