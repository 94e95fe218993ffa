"""Tests of benchmarks/train_record.py: how two training runs' losses are compared."""

from __future__ import annotations

import pytest


def test_train_record_agreement_compares_eval_losses_and_window_means():
    from benchmarks import train_record

    cuda = [{"step": s, "loss": 2.0 + (0.1 if s % 2 else -0.1)} for s in range(1, 8)] + [
        {"step": 4, "eval_loss": 1.5},
        {"step": 7, "eval_loss": 1.2},
    ]
    baseline = [{"step": s, "loss": 2.0} for s in range(1, 10)] + [
        {"step": 4, "eval_loss": 1.5},
        {"step": 8, "eval_loss": 1.0},
    ]
    result = train_record.agreement(cuda, baseline, window=2)
    # Eval losses only where both runs measured (step 4); windows only as far as the shorter run (7 -> 3).
    assert result["eval_loss"] == {"relative_gaps": [(4, 0.0)], "within_1pct": True}
    windows = result["train_loss_2_step_means"]
    assert [key for key, _ in windows["relative_gaps"]] == ["1-2", "3-4", "5-6"]
    assert all(abs(g) < 1e-12 for _, g in windows["relative_gaps"]) and windows["within_1pct"]
    off = train_record.agreement([{"step": 1, "loss": 2.05}, {"step": 2, "loss": 2.0}], baseline[:2], window=2)
    assert off["train_loss_2_step_means"]["relative_gaps"] == [("1-2", pytest.approx(0.0125))]
    assert not off["train_loss_2_step_means"]["within_1pct"] and not off["eval_loss"]["within_1pct"]
