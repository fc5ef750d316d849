"""
The metrics streamed in blocks of queries: any blocking gives the same numbers, a clean matrix spilled to disk gives
those of one kept in memory (and its folder goes), the correlation's sampled pairs do not depend on the blocking, and
the streamed noise-aware rate is the one of whole matrices.
"""


import os

import numpy as np
import pytest
import torch
from helpers import metric_passes

from art_malleability import metrics as M
from art_malleability.metrics import _spearman
from art_malleability.metrics._summary import pass_metrics
from art_malleability.metrics.accumulators import CleanScores, PerturbedScores


def _metrics(before, after, block, memory_bytes=None, folder=None, control=None, keep_draws=False, device=None,
             **kwargs):
    _, perturbed = metric_passes(before, after, 60, 3, block, memory_bytes=memory_bytes, folder=folder, device=device)
    return pass_metrics(perturbed, control=control, keep_draws=keep_draws, **kwargs)


def _same(first, second) -> None:
    if not isinstance(first, dict):
        first, second = first.to_dict(), second.to_dict()
    assert first.keys() == second.keys()
    for key, value in first.items():
        if key == "resamples" or isinstance(value, list):
            assert value == second[key], key
        elif isinstance(value, dict):
            _same(value, second[key])
        else:
            np.testing.assert_allclose(np.asarray(value, dtype=float), np.asarray(second[key], dtype=float),
                                       rtol=1e-10, atol=1e-9, err_msg=key)  # EM-fitted values: 1e-9


@pytest.fixture
def pair(rng):
    before = rng.normal(size=(37, 80)) + 0.5 * rng.normal(size=80)
    after = 0.6 * before + rng.normal(size=before.shape)
    before[4, 10] = after[4, 10] = np.nan  # a self-pair
    after[7, 3] = np.nan
    return before, after


def test_any_blocking_gives_the_same_metrics(pair):
    before, after = pair
    whole = M.malleability_metrics(before, after, n_bootstrap=60, seed=3, keep_draws=True)
    for block in (1, 5, 37):
        _same(whole, _metrics(before, after, block, keep_draws=True))


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]),
])
def test_scores_on_a_device_give_the_numbers_of_numpy_arrays(pair, device):
    # the sums, resamples, sampled pairs and per-query sets live on the scores' device; the numbers are those of
    # numpy blocks on the CPU, a control's excess included
    before, after = pair
    control = _metrics(before, 0.5 * before + 0.3 * after, 5, keep_draws=True)
    want = _metrics(before, after, 5, control=control, keep_draws=True)
    got = _metrics(before, after, 5, control=control, keep_draws=True, device=device)
    _same(want, got)
    assert got.excess_flip_rate is not None


def test_a_clean_matrix_spilled_to_disk_gives_the_same_metrics_and_its_folder_goes(pair, tmp_path):
    before, after = pair
    clean = CleanScores(M.QueryResampling(len(before), 60, 3), before.shape[1], memory_bytes=100, folder=tmp_path)
    clean.add(before)
    folders = list(tmp_path.iterdir())
    assert len(folders) == 1 and (folders[0] / "clean_scores.f64").stat().st_size == 8 * before.size
    clean.finish()
    assert list(tmp_path.iterdir()) == []  # the folder it created, and only that, is gone
    _same(_metrics(before, after, 6), _metrics(before, after, 6, memory_bytes=100, folder=tmp_path))
    assert list(tmp_path.iterdir()) == []


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident set from /proc (Linux)")
def test_a_clean_matrix_on_disk_stays_out_of_the_resident_memory(tmp_path):
    """Written and read with file calls, not mapped: 256 MiB of clean scores add no more than a block to the RSS."""
    from art_malleability.metrics.accumulators import _ScoreStore

    n_query, n_train = 2048, 16384
    store = _ScoreStore(n_query, n_train, torch.device("cpu"), memory_bytes=0, folder=tmp_path)
    block = torch.ones((64, n_train), dtype=torch.float64)  # 8 MiB
    before = _resident_bytes()
    for s in range(0, n_query, 64):
        store.put(s, block * s)
    grown = _resident_bytes() - before
    columns = store.columns(np.array([0, 5, n_train - 1]))
    assert grown < 64 * 2**20, f"{grown / 2**20:.0f} MiB"
    expected = np.repeat(np.arange(0, n_query, 64, dtype=np.float64), 64)[:, None].repeat(3, 1)
    np.testing.assert_array_equal(columns.numpy(), expected)
    store.close()
    assert list(tmp_path.iterdir()) == []


def test_a_failed_pass_leaves_no_folder(pair, tmp_path):
    before, _ = pair
    clean = CleanScores(M.QueryResampling(len(before), 10, 0), before.shape[1], memory_bytes=100, folder=tmp_path)
    clean.add(before[:5])
    with pytest.raises(ValueError, match="must hold 37 queries, got 5"):
        clean.finish()
    del clean
    assert list(tmp_path.iterdir()) == []


def test_blocks_are_checked(pair):
    before, after = pair
    clean = CleanScores(M.QueryResampling(len(before), 10, 0), before.shape[1])
    with pytest.raises(ValueError, match=r"block of influence rows of shape \(n, 80\)"):
        clean.add(before[:, :5])
    with pytest.raises(ValueError, match="clean must be finished"):
        PerturbedScores(clean)
    clean.add(before)
    with pytest.raises(ValueError, match="must hold 37 queries, got at least 38"):
        clean.add(before[:1])
    clean.finish()
    perturbed = PerturbedScores(clean)
    perturbed.add(after[:10])
    with pytest.raises(ValueError, match="perturbed scores must hold 37 queries, got 10"):
        pass_metrics(perturbed)


def test_sampled_pairs_do_not_depend_on_the_blocking(pair, monkeypatch):
    """Above the cap each query keeps a seeded share of its pairs: the same pairs, however the queries are blocked."""
    before, after = pair
    monkeypatch.setattr(_spearman, "SPEARMAN_PAIRS", 1000)
    results = [_metrics(before, after, block, keep_draws=True) for block in (1, 7, 37)]
    for other in results[1:]:
        assert other.spearman == results[0].spearman
        np.testing.assert_array_equal(other.replicates.spearman, results[0].replicates.spearman)
    clean = CleanScores(M.QueryResampling(len(before), 10, 3), before.shape[1])
    clean.add(before)
    clean.finish()
    kept = clean.pairs.rows.numel()
    assert clean.pairs.share == pytest.approx(1000 / before.size)
    assert abs(kept - 1000) < 4 * np.sqrt(1000)
    rows, cols = clean.pairs.rows.numpy(), clean.pairs.cols.numpy()
    sampled_b, sampled_a = before[rows, cols], after[rows, cols]
    keep = np.isfinite(sampled_b) & np.isfinite(sampled_a)
    from scipy.stats import spearmanr

    assert results[0].spearman.value == pytest.approx(spearmanr(sampled_b[keep], sampled_a[keep]).statistic,
                                                      abs=1e-12)


def test_the_streamed_noise_aware_rate_is_that_of_whole_matrices(pair):
    before, after = pair
    streamed = M.malleability_metrics(before, after, n_bootstrap=150, seed=2)
    whole = M.noise_aware_flip_rate(before, after)
    assert streamed.noise_aware_flip_rate.value == pytest.approx(whole["estimate"], abs=1e-9)
    assert streamed.noise_aware_flip_rate.interval == pytest.approx(whole["ci"], abs=1e-9)
    assert streamed.undecided_share == whole["undecided_share"]
    assert streamed.flip_rate_null == pytest.approx(whole["null_raw_flip_rate"], abs=1e-9)


def test_the_signed_retention_reads_as_stated(rng):
    """1 when nothing changes, 0 when the set's influence is wiped out, -1 when every sign is reversed."""
    before = rng.normal(size=(30, 50)) + 3 * rng.normal(size=50)
    for after, expected in ((before, 1.0), (np.zeros_like(before), 0.0), (-before, -1.0)):
        result = M.malleability_metrics(before, after, n_bootstrap=50)
        assert result.signed_retention.value == pytest.approx(expected, abs=1e-12)


def test_each_querys_own_set_is_that_of_top_indices_ties_and_nan_included(rng):
    """The per-query sets come from a partial selection, fixed up where keys tie across the set's boundary."""
    import torch

    from art_malleability.metrics.accumulators import _QueryTops

    for _ in range(150):
        n_query, n_train = int(rng.integers(1, 8)), int(rng.integers(3, 40))
        scores = np.round(rng.normal(size=(n_query, n_train)) * rng.choice([0.5, 3.0]))
        scores[rng.random(scores.shape) < 0.2] = np.nan
        fraction, rank_by = float(rng.choice([0.1, 0.3, 0.5, 1.0])), str(rng.choice(["abs", "signed"]))
        tops = _QueryTops(n_query, n_train, fraction, rank_by, torch.device("cpu"))
        tops.add(0, torch.as_tensor(scores))  # a set share that selects none included (n_train * fraction < 1)
        if tops.width == 0:
            assert int(tops.size.sum()) == 0
            assert bool(torch.isnan(tops.flip_rates(0, torch.as_tensor(scores))).all())
        for q in range(n_query):
            expected = M.top_indices(scores[q], M.top_k_count(int(np.isfinite(scores[q]).sum()), fraction), rank_by)
            assert set(tops.index[q, : int(tops.size[q])].tolist()) == set(expected.tolist())
