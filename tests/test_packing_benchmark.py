"""benchmarks/packing.py's token accounting against hand-derived counts, its long-tail fit, and a --quick run of the
token section that writes only where it is told."""

import json
import math

import pytest
from conftest import REPO

from benchmarks import packing


def test_padded_and_packed_token_and_attention_counts_by_hand():
    # totals [10, 2, 2, 2] (1-token prompts), 2 rows per micro-batch: sorted by length, [2, 2] and [2, 10]; each
    # micro-batch pays rows x its width: 2 x 2 + 2 x 10 = 24 positions for 16 useful tokens
    mask, width = packing.rows_from_lengths([1, 1, 1, 1], [9, 1, 1, 1])
    padded = packing.account(mask, width, num_minibatches=1, micro_batch_size=2, micro_batch_tokens=0, seed=0)
    assert (padded["forwards"], padded["tokens_fed"], padded["useful_tokens"]) == (2, 24, 16)
    assert padded["tokens_per_useful"] == 1.5 and padded["largest_forward_tokens"] == 20
    # attention: rows x width^2 = 2 x 4 + 2 x 100; per sequence 100 + 4 + 4 + 4
    assert padded["attention_dense"] == 208 and padded["attention_sum_l2"] == 112
    # packed, bins of 12 tokens: first-fit decreasing makes [10, 2] and [2, 2]: every position is a useful token
    packed = packing.account(mask, width, num_minibatches=1, micro_batch_size=2, micro_batch_tokens=12, seed=0)
    assert (packed["forwards"], packed["tokens_fed"], packed["tokens_per_useful"]) == (2, 16, 1.0)
    # through a dense mask each bin costs its tokens squared (12^2 + 4^2); per sequence the same 112 as padded rows
    assert packed["attention_dense"] == 160 and packed["attention_sum_l2"] == 112


def test_a_padded_micro_batch_pays_its_longest_prompt_plus_its_longest_completion():
    # rows (prompt 3, completion 1) and (prompt 1, completion 5): the longest row is 6 tokens, but the two rows share
    # one [left-padded prompt | right-padded completion] layout 3 + 5 = 8 columns wide: 16 positions for 10 tokens
    mask, width = packing.rows_from_lengths([3, 1], [1, 5])
    padded = packing.account(mask, width, num_minibatches=1, micro_batch_size=2, micro_batch_tokens=0, seed=0)
    assert (padded["tokens_fed"], padded["useful_tokens"], padded["tokens_per_useful"]) == (16, 10, 1.6)
    assert padded["attention_dense"] == 2 * 8**2 and padded["attention_sum_l2"] == 4**2 + 6**2


def test_the_long_tail_fit_keeps_the_published_mean_after_truncation():
    for mean, sigma in [(1000.0, 0.7), (390.0, 0.5), (1000.0, 1.0)]:
        mu = packing.fit_mu(mean, sigma, 3000)
        assert packing.clipped_lognormal_mean(mu, sigma, 3000) == pytest.approx(mean, rel=1e-9)
    # far below the clip, the clipped mean is the lognormal's own exp(mu + sigma^2 / 2)
    assert packing.clipped_lognormal_mean(math.log(10), 0.5, 1e9) == pytest.approx(10 * math.exp(0.125))
    prompts, completions = packing.long_tail_lengths(128, 8, 1000.0, 0.7, 3000, seed=1)
    assert len(prompts) == len(completions) == 1024 and max(completions) == 3000 and min(completions) >= 1
    assert all(len(set(prompts[i : i + 8])) == 1 for i in range(0, 1024, 8))  # a group shares its prompt
    assert max(prompts) <= packing.MAX_PROMPT_TOKENS and sum(completions) / 1024 == pytest.approx(1000, rel=0.08)


def test_quick_token_section_writes_only_under_its_out_folder(tmp_path):
    default = REPO / "benchmarks" / "results" / "packing"
    before = {p: p.stat().st_mtime for p in default.rglob("*")} if default.exists() else None
    result = packing.main(["--quick", "--sections", "tokens", "--out", str(tmp_path / "out")])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["lengths.png", "results.json", "table.md"]
    after = {p: p.stat().st_mtime for p in default.rglob("*")} if default.exists() else None
    assert after == before  # the committed results folder is untouched
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    # the command as run, no machine path (an OMP_NUM_THREADS prefix when the variable is set)
    assert saved["command"].endswith("python benchmarks/packing.py --quick --sections tokens --out out")
    for case in result["tokens"]:  # the aim: packed computes at most 1.05 tokens per useful token
        assert case["packed"]["tokens_per_useful"] <= 1.05 and case["padded"]["tokens_per_useful"] >= 1.0
        assert case["packed"]["useful_tokens"] == case["padded"]["useful_tokens"]
    assert "## Tokens computed per useful token" in (tmp_path / "out" / "table.md").read_text()
