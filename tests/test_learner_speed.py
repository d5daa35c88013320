"""The learner's speed settings (issue 41, parts 2-4), each checked for numbers on the CPU: fused AdamW against the
foreach step, a bf16 frozen LoRA base against the fp32 one, selective checkpointing against full recompute, the varlen
attention wiring (with its per-sequence stand-in) and packed flex attention against eager, compiled layers against
eager (slow tier)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.attention import per_sequence_attention, register_varlen, varlen_kwargs
from common.data import TINY_MODEL_DIR
from common.learner_speed import compile_layers, enable_checkpointing, fuse_adamw, hold_frozen_linears_in_bf16
from common.logprobs import token_logprobs
from common.lora import LoraConfig, apply_lora


def tiny(attention: str = "eager") -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, attn_implementation=attention)


@pytest.fixture(scope="module")
def rows():
    """4 rows of [left-padded prompt (10) | right-padded completion (20)], lengths differing."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 279, (4, 30), generator=g)
    mask = torch.ones(4, 30, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, 22:] = 0
    mask[3, :2], mask[3, 25:] = 0, 0
    return ids, mask


def update(model, ids, mask, packed=False, autocast=False, **kwargs):
    """(log-probs, {name: gradient}) of one surrogate backward through token_logprobs."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logprobs, _ = token_logprobs(model, ids, mask, 20, 1.0, packed=packed, **kwargs)
    (logprobs * torch.linspace(-1, 1, 20)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), grads


# --- part 3: fused AdamW ---------------------------------------------------------------------------------------


def test_fused_adamw_takes_the_foreach_step():
    """fuse_adamw switches a fresh default AdamW to the fused kernel (on CUDA; here the CPU's fused kernel, the same
    algorithm): three steps land on the foreach steps' weights to fp32 rounding (measured: 3.7e-9 largest difference),
    and an optimiser that already stepped, chose an implementation or holds CPU tensors (on CUDA's list) is left
    alone."""
    torch.manual_seed(0)
    start = [torch.randn(64, 32), torch.randn(32)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(3)]
    finals = {}
    for kind in ("foreach", "fused"):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        if kind == "foreach":
            opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True)
        else:
            opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
            assert fuse_adamw(opt, device_types=("cpu",))
            assert opt.param_groups[0]["fused"] is True and opt.param_groups[0]["foreach"] is False
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        finals[kind] = [p.detach() for p in params]
    for a, b in zip(finals["foreach"], finals["fused"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # left alone: CPU parameters under the CUDA default, an explicit choice, a stepped optimiser
    p = torch.nn.Parameter(torch.ones(3))
    assert not fuse_adamw(torch.optim.AdamW([p]))
    assert not fuse_adamw(torch.optim.AdamW([p], foreach=False), device_types=("cpu",))
    stepped = torch.optim.AdamW([p])
    p.grad = torch.ones(3)
    stepped.step()
    assert not fuse_adamw(stepped, device_types=("cpu",))
    assert not fuse_adamw(torch.optim.SGD([p], lr=0.1), device_types=("cpu",))


# --- part 3: a bf16 frozen LoRA base ----------------------------------------------------------------------------


def lora_policy():
    model = apply_lora(tiny(), LoraConfig(rank=4), seed=0)
    with torch.no_grad():  # live adapters (B = 0 at initialisation)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    return model.train()


def test_bf16_frozen_base_changes_no_number_under_autocast(rows):
    """Under bf16 autocast a frozen LoRA base held in bf16 gives the fp32 base's log-probs and adapter gradients
    exactly: autocast computes those matmuls from the bf16-rounded weights either way (measured: 0 difference). Only
    the decoder's frozen linear layers are cast: embeddings, norms, the head and the adapters keep fp32."""
    ids, mask = rows
    torch.manual_seed(1)
    fp32 = lora_policy()
    bf16 = lora_policy()
    bf16.load_state_dict(fp32.state_dict())
    cast = hold_frozen_linears_in_bf16(bf16)
    layer = bf16.get_base_model().model.layers[0]
    assert layer.self_attn.q_proj.base_layer.weight.dtype == torch.bfloat16
    assert layer.self_attn.q_proj.lora_A["default"].weight.dtype == torch.float32
    assert bf16.get_base_model().lm_head.weight.dtype == torch.float32
    assert layer.input_layernorm.weight.dtype == torch.float32
    # every base matmul of every layer: q, o (H x H), k, v (H x kv), gate, up, down (H x I), with q/k/v biases
    config = bf16.config
    kv = config.num_key_value_heads * config.hidden_size // config.num_attention_heads
    h, i = config.hidden_size, config.intermediate_size
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + h + 2 * kv
    assert cast == config.num_hidden_layers * per_layer
    lp32, g32 = update(fp32, ids, mask, autocast=True)
    lp16, g16 = update(bf16, ids, mask, autocast=True)
    torch.testing.assert_close(lp16, lp32, rtol=0, atol=0)
    assert g16.keys() == g32.keys() and all("lora_" in n for n in g16)
    for name in g32:
        torch.testing.assert_close(g16[name], g32[name], rtol=0, atol=0)


# --- part 3: selective activation checkpointing ------------------------------------------------------------------


class CountMatmuls(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts aten.mm calls (the decoder's matmuls at the dispatch level, recomputations included)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func == torch.ops.aten.mm.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("policy", ["op", "every-2"])
def test_selective_checkpointing_gives_full_recomputes_gradients(rows, policy):
    """torchtitan's per-op policy and every-second-layer checkpointing give the gradients of full recomputation
    (measured: identical here; bounded at fp32 rounding), and recompute less: the step runs fewer matmuls than full
    recomputation and more than none (op: every second matmul of a layer is recomputed, the others saved; every-2:
    half the layers recomputed)."""
    ids, mask = rows
    results, matmuls = {}, {}
    for which in ("full", policy, "none"):
        torch.manual_seed(0)
        model = tiny().train()
        if which != "none":
            enable_checkpointing(model, which)
        with CountMatmuls() as counter:
            results[which] = update(model, ids, mask)
        matmuls[which] = counter.count
    for name, grad in results["full"][1].items():
        torch.testing.assert_close(results[policy][1][name], grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[policy][0], results["full"][0], rtol=0, atol=0)
    assert matmuls["none"] < matmuls[policy] < matmuls["full"], matmuls


def test_unknown_checkpointing_policy_is_refused():
    with pytest.raises(SystemExit, match="--checkpointing-policy"):
        enable_checkpointing(tiny(), "sometimes")


# --- part 2: varlen attention, registered as transformers takes it ----------------------------------------------


def test_varlen_kwargs_mark_each_sequence():
    kwargs = varlen_kwargs(torch.tensor([3, 5, 2]), 8)
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 3, 8, 10] and kwargs["cu_seq_lens_q"].dtype == torch.int32
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 8


def test_per_sequence_standin_is_causal_attention_within_each_sequence():
    """Two sequences of 2 and 1 tokens, one head of dimension 1, scale 1: by hand. Query/key/value of token t are
    q_t, k_t, v_t; the first sequence's second token attends to tokens 0 and 1 with weights softmax(q_1 k_0, q_1 k_1);
    the third token (a sequence of its own) sees only itself."""
    q = torch.tensor([[[1.0]], [[2.0]], [[5.0]]])
    k = torch.tensor([[[0.0]], [[1.0]], [[3.0]]])
    v = torch.tensor([[[10.0]], [[20.0]], [[7.0]]])
    out = per_sequence_attention(q, k, v, torch.tensor([0, 2, 3]), scale=1.0).flatten()
    w = torch.softmax(torch.tensor([0.0, 2.0]), 0)  # q_1 k_0 = 0, q_1 k_1 = 2
    assert out.tolist() == pytest.approx([10.0, float(w[0] * 10 + w[1] * 20), 7.0])


def test_varlen_registration_runs_packed_rows_as_eager_does(rows, monkeypatch):
    """A model loaded with attn_implementation='varlen' (registered through AttentionInterface and
    ALL_MASK_ATTENTION_FUNCTIONS) runs a packed micro-batch through the varlen function with cu_seq_lens and no mask
    (the per-sequence stand-in on the CPU), with gradients; its log-probs and gradients equal eager's padded ones to
    fp32 rounding (measured: 3.8e-6 on a log-prob, 1.7e-5 on a gradient element), and a padded forward (the HF
    engine's decode, no cu_seq_lens) falls back to sdpa; token_logprobs runs padded rows packed on it."""
    import common.attention as attention

    ids, mask = rows
    name = register_varlen()
    calls = []
    standin = attention.per_sequence_attention
    monkeypatch.setattr(attention, "per_sequence_attention", lambda *a: calls.append(a[3].tolist()) or standin(*a))
    eager, varlen = tiny(), tiny(name)
    assert varlen.config._attn_implementation == name
    lp_eager, g_eager = update(eager, ids, mask)
    lp_varlen, g_varlen = update(varlen, ids, mask, packed=True)
    lengths = mask.sum(-1).tolist()
    cumulative = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    assert calls and all(c == cumulative for c in calls)  # every layer, every sequence boundary
    assert len(calls) == varlen.config.num_hidden_layers  # once per layer (no checkpointing: no recomputation)
    torch.testing.assert_close(lp_varlen, lp_eager, rtol=0, atol=1e-5)
    for n, g in g_eager.items():
        torch.testing.assert_close(g_varlen[n], g, rtol=1e-4, atol=1e-5)
    calls.clear()
    with torch.no_grad():
        padded, _ = token_logprobs(varlen, ids, mask, 20, 1.0, packed=False)
    # token_logprobs runs padded rows packed on a varlen model (causal, no mask): the same calls as the packed layout
    assert calls == [cumulative] * varlen.config.num_hidden_layers
    torch.testing.assert_close(padded, lp_eager, rtol=0, atol=1e-5)
    calls.clear()
    with torch.no_grad():  # a plain padded forward (the HF engine's decode: no cu_seq_lens) falls back to sdpa
        logits = varlen(input_ids=ids, attention_mask=mask).logits
    assert not calls
    real = mask.bool()  # padding positions attend to nothing: their logits are each kernel's own garbage
    torch.testing.assert_close(logits[real], eager(input_ids=ids, attention_mask=mask).logits[real], rtol=0, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's varlen kernel is CUDA-only")
def test_cuda_varlen_kernel_matches_the_per_sequence_standin():
    """On a GPU: PyTorch's varlen kernel (FlashAttention-2, bf16) against the stand-in in fp32, three packed sequences
    with grouped-query heads (12 query heads over 2 key/value heads, as Qwen2.5-1.5B), to bf16's resolution."""
    from common.attention import _cuda_varlen

    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [7, 1, 40]
    n = sum(lengths)
    q = torch.randn(n, 12, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(n, 2, 64, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    cu = varlen_kwargs(torch.tensor(lengths, device="cuda"), max(lengths))["cu_seq_lens_q"]
    out = _cuda_varlen(q, k, v, cu, cu, max(lengths), max(lengths), 64**-0.5)
    expected = per_sequence_attention(q.float(), k.float(), v.float(), cu, 64**-0.5)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


# --- part 2: flex attention on packed rows (forward only on the CPU) ---------------------------------------------


@pytest.mark.slow
def test_packed_flex_attention_matches_eager_without_grad(rows):
    """transformers' flex_attention builds a document block mask from the restarting position_ids of a packed row
    (no N x N tensor); on the CPU it runs forward only. Its log-probs equal eager's to fp32 rounding (its first call
    compiles: ~20 s)."""
    ids, mask = rows
    with torch.no_grad():
        expected, _ = token_logprobs(tiny(), ids, mask, 20, 1.0)
        flex, _ = token_logprobs(tiny("flex_attention"), ids, mask, 20, 1.0, packed=True)
    torch.testing.assert_close(flex, expected, rtol=0, atol=1e-5)


# --- part 4: compiled decoder layers -----------------------------------------------------------------------------


@pytest.mark.slow
def test_compiled_layers_match_eager(rows):
    """Each decoder layer torch.compile'd on its own (--compile) gives eager's log-probs and gradients to fp32
    rounding (inductor fuses and reorders the elementwise work), padded and packed."""
    ids, mask = rows
    eager, compiled = tiny(), tiny()
    assert compile_layers(compiled) == compiled.config.num_hidden_layers
    for packed in (False, True):
        lp, grads = update(eager, ids, mask, packed=packed)
        lp_c, grads_c = update(compiled, ids, mask, packed=packed)
        torch.testing.assert_close(lp_c, lp, rtol=0, atol=1e-5)
        for n, g in grads.items():
            torch.testing.assert_close(grads_c[n], g, rtol=1e-4, atol=1e-5)
