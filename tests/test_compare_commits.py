"""scripts/compare_commits.py's row comparison: what counts as a difference between two runs' metrics."""

import importlib.util

from conftest import REPO

spec = importlib.util.spec_from_file_location("compare_commits", REPO / "scripts" / "compare_commits.py")
compare_commits = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_commits)


def test_a_new_key_is_a_difference_unless_allowed_and_a_changed_value_always_is():
    base = [{"step": 1, "train/loss": 0.5}]
    with_new_key = [{"step": 1, "train/loss": 0.5, "train/is_ess": 1.0}]
    assert compare_commits.compare(base, base) == []
    assert compare_commits.compare(base, with_new_key) == ["step 1: train/is_ess only at head"]
    assert compare_commits.compare(base, with_new_key, new_keys_ok=True) == []
    changed = [{"step": 1, "train/loss": 0.5000001, "train/is_ess": 1.0}]
    assert compare_commits.compare(base, changed, new_keys_ok=True) == [
        "step 1: train/loss 0.5 (base) != 0.5000001 (head)"
    ]
    assert compare_commits.compare(with_new_key, base, new_keys_ok=True) == ["step 1: train/is_ess only at base"]
