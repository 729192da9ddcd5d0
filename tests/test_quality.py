"""Teacher-forced metrics (gemma_export.quality) on hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gemma_export.errors import GemmaExportError
from gemma_export.quality import compare_logits


def test_metrics_match_hand_computed_values():
    # reference rows: uniform over 2 words; model rows: softmax([ln 3, 0]) = [0.75, 0.25]
    reference = np.zeros((3, 2), np.float32)
    reference[2] = [0.0, 1.0]  # row 2: the reference prefers word 1, the model word 0
    model = np.tile(np.array([math.log(3.0), 0.0], np.float32), (3, 1))
    ids = [0, 1, 0]  # row 0 predicts 1, row 1 predicts 0
    m = compare_logits(reference, model, ids, chunk=2)  # two chunks
    kl_uniform = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    p2 = np.exp([0.0, 1.0]) / np.exp([0.0, 1.0]).sum()
    kl_row2 = p2[0] * math.log(p2[0] / 0.75) + p2[1] * math.log(p2[1] / 0.25)
    assert m.tokens == 3
    assert m.top1_agreement == pytest.approx(2 / 3)
    assert m.first_disagreement == 2
    assert m.top1_agreement_past_512 is None
    assert m.kl_mean == pytest.approx((2 * kl_uniform + kl_row2) / 3, rel=1e-6)
    assert m.max_abs_logit_diff == pytest.approx(math.log(3.0), rel=1e-6)
    # perplexity over rows 0 and 1: targets 1 (q = 0.25) and 0 (q = 0.75)
    assert m.perplexity == pytest.approx(math.exp(-(math.log(0.25) + math.log(0.75)) / 2), rel=1e-6)
    assert m.reference_perplexity == pytest.approx(2.0, rel=1e-6)


def test_identical_logits_agree_fully():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(600, 50)).astype(np.float32)
    m = compare_logits(logits, logits.copy(), rng.integers(0, 50, 600).tolist())
    assert m.top1_agreement == 1.0 and m.top1_agreement_past_512 == 1.0
    assert m.kl_mean == pytest.approx(0.0, abs=1e-12) and m.max_abs_logit_diff == 0.0
    assert m.first_disagreement is None


def test_shape_mismatch_is_refused():
    with pytest.raises(GemmaExportError, match=r"expected two \[T, V\] matrices with T = 3 tokens"):
        compare_logits(np.zeros((3, 4), np.float32), np.zeros((3, 5), np.float32), [0, 1, 2])
