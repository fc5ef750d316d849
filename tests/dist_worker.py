"""
A sharded audit for the multi-process tests, launched by ``torchrun`` (or called in one process as the
reference): ``python tests/dist_worker.py OUT_DIR [ok|die]``.

Rank 0 writes ``report.json`` and ``scores.npy`` (the full clean influence matrix) into ``OUT_DIR``.
Fault modes: ``die`` — rank 1 exits abruptly in the middle of the audit (after the clean influence,
in the first attack's update), as a crashed worker would; ``hang`` — rank 1 stops answering there
(the others must give up after the collective timeout, 10 s here); ``tiny`` — a training set of one
example for two processes; ``userinf`` — an influence estimator built with ``distributed=False``.
``work`` runs only the audit, keeping its stages in ``OUT_DIR/work``; ``work-die`` the same, with rank 1 exiting
abruptly in its refit after the first attack's (the controls' and the first attack's passes finished); ``work-none``
the same audit without a work folder. ``dual`` runs the audit with the dual solve (``n <= k``) instead of the primal
one. ``exact`` and ``exact-ce``
run the exact NTK influence (``projection_dim=None``: the tiles of the kernel and its factor dealt out over the
processes) with the MSE and the cross-entropy loss, the audit with the default ``projection_dim="auto"`` (exact
here), and the tiled dual solve on a random kernel with its tiles in memory and on disk (``tiles.npz``).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import torch


def problem():
    """A small trained CNN on random images: deterministic, seeded, quick."""
    from art_malleability.models import SmallCNN, make_classifier, train_model

    rng = np.random.default_rng(0)
    x = rng.random((90, 1, 8, 8), dtype=np.float32)
    y = (x[:, 0, :4].mean(axis=(1, 2)) > x[:, 0, 4:].mean(axis=(1, 2))).astype(np.int64) + 2 * (
        x[:, 0, :, :4].mean(axis=(1, 2)) > 0.5
    )
    model = train_model(
        SmallCNN((1, 8, 8), 4, seed=0), x[:70], y[:70], epochs=5, lr=1e-2, seed=0, verbose=False, device="cpu"
    )
    return make_classifier(model, (1, 8, 8), 4, device="cpu"), x[:70], y[:70], x[70:], y[70:]


def run(out: str, mode: str = "ok") -> None:
    from art_malleability import MalleabilityEstimator
    from art_malleability.distributed import init_from_env
    from art_malleability.influence import NTKInfluence

    torch.set_num_threads(1)
    shard = init_from_env("gloo", timeout_s=10 if mode == "hang" else 60)
    # the process group is the launch's: a worker that fell back to one process would compare a run with itself
    assert shard.world_size == int(os.environ.get("WORLD_SIZE", "1")), (shard.world_size, os.environ.get("WORLD_SIZE"))
    clf, x, y, xq, yq = problem()
    if mode.startswith("work"):
        resumable_audit(shard, clf, x, y, xq, yq, out, mode)
        return
    if mode in ("die", "hang") and shard.rank == 1:

        def fault(*args, **kwargs):
            if mode == "die":
                os._exit(7)
            time.sleep(600)

        NTKInfluence.refit = fault
    if mode == "tiny":
        MalleabilityEstimator(clf, projection_dim=48, top_fraction=1.0, verbose=False, device="cpu").evaluate(
            x[:1], y[:1], xq, yq
        )
    if mode == "userinf":  # an influence estimator told not to shard, in a sharded audit
        influence = NTKInfluence(projection_dim=48, device="cpu", distributed=False)
        MalleabilityEstimator(clf, influence=influence, verbose=False, device="cpu").evaluate(x, y, xq, yq)
    k = 256 if mode == "dual" else 48  # n = 70: the dual solve on ΦΦᵀ (n <= k) or the primal one
    exact = mode.startswith("exact")
    loss = "cross_entropy" if mode == "exact-ce" else "mse"
    est = NTKInfluence(projection_dim=None if exact else k, device="cpu", loss=loss).fit(clf.model, x, y)
    scores = est.scores(xq, yq)
    # refit contract: every process passes the whole change
    changed = np.array([2, 40, 41, 69])
    est.refit(changed, np.clip(x[changed] + 0.1, 0.0, 1.0))
    refitted = est.scores(xq, yq)
    own = est.self_influence()  # the projected modes take it from the kept features (each process its rows)
    report = MalleabilityEstimator(
        clf, projection_dim="auto" if exact else k, n_queries=12, n_bootstrap=40, verbose=False, device="cpu",
        attack_max_iter=5,
    ).evaluate(x, y, xq, yq)
    if shard.rank == 0:
        os.makedirs(out, exist_ok=True)
        np.save(os.path.join(out, "scores.npy"), scores)
        np.save(os.path.join(out, "refitted.npy"), refitted)
        np.save(os.path.join(out, "self.npy"), own)
        with open(os.path.join(out, "report.json"), "w") as handle:
            json.dump(report.to_dict(), handle)
    if exact:
        tiles = tiled_solves(shard, out)
        if shard.rank == 0:
            np.savez(os.path.join(out, "tiles.npz"), **tiles)


def resumable_audit(shard, clf, x, y, xq, yq, out: str, mode: str) -> None:
    """The audit of ``work``, ``work-die`` and ``work-none`` (see the module's docstring)."""
    from art_malleability import MalleabilityEstimator
    from art_malleability.influence import NTKInfluence

    if mode == "work-die" and shard.rank == 1:
        refit, done = NTKInfluence.refit, []

        def dies_at_the_second_attack(self, *args, **kwargs):
            done.append(1)
            if len(done) == 4:  # two control draws and the first attack finished
                os._exit(7)
            return refit(self, *args, **kwargs)

        NTKInfluence.refit = dies_at_the_second_attack
    report = MalleabilityEstimator(
        clf, attacks=("fgsm", "pgd"), projection_dim=48, n_queries=12, n_bootstrap=40, verbose=False, device="cpu",
        attack_max_iter=5, control_draws=2, work_dir=None if mode == "work-none" else os.path.join(out, "work"),
    ).evaluate(x, y, xq, yq)
    if shard.rank == 0:
        with open(os.path.join(out, "report.json"), "w") as handle:
            json.dump(report.to_dict(), handle)


def tiled_solves(shard, out: str) -> dict:
    """The tiled dual solve of a random kernel, tiles in memory and on disk, before and after a row update."""
    from art_malleability.linalg.ridge import DualRidge

    rng = np.random.default_rng(1)
    phi = rng.normal(size=(45, 30))
    kernel = torch.tensor(phi @ phi.T)
    targets = torch.tensor(rng.normal(size=(45, 3)))
    changed = np.array([3, 20, 44])
    new_phi = phi.copy()
    new_phi[changed] += rng.normal(size=(3, 30))
    rows = torch.tensor(new_phi[changed] @ new_phi.T)
    queries = torch.tensor(rng.normal(size=(5, 30)) @ phi.T)
    found = {}
    for where in ("memory", "disk"):
        folder = None
        if where == "disk":
            folder = os.path.join(out + "-tiles", str(shard.rank))
            os.makedirs(folder, exist_ok=True)
        solver = DualRidge(1e-2, block=7, folder=folder, group=shard).fit(lambda r, c: kernel[r][:, c], targets)
        found[f"{where}_alpha"] = solver.alpha_.numpy()
        found[f"{where}_b"] = solver.loo_parts(queries)[1].numpy()
        solver.update(changed, rows)
        found[f"{where}_alpha_updated"] = solver.alpha_.numpy()
        found[f"{where}_diag_updated"] = solver.cinv_diag_.numpy()
        asked = []

        def columns(cols, asked=asked):
            asked.extend(np.asarray(cols).tolist())
            return rows[:, torch.as_tensor(cols)]

        solver.update(changed, columns)  # each process asks for the columns of its own tile rows only
        found[f"{where}_alpha_by_columns"] = solver.alpha_.numpy()
        found[f"{where}_diag_by_columns"] = solver.cinv_diag_.numpy()
        found[f"{where}_asked"] = np.array(len(set(asked)))
        one_phi = phi.copy()
        one_phi[changed[:1]] = new_phi[changed[:1]]
        one_row = torch.tensor(one_phi[changed[:1]] @ one_phi.T)

        def one_column_set(cols, one_row=one_row):  # like the kernel engine, it refuses an empty block
            if len(cols) == 0:
                raise ValueError("x2 must hold at least one example")
            return one_row[:, torch.as_tensor(cols)]

        solver.update(changed[:1], one_column_set)  # fewer changed rows than processes: one asks for none
        found[f"{where}_alpha_one_changed"] = solver.alpha_.numpy()
        solver.close()
        if folder is not None:
            found[f"{where}_left"] = np.array(len(os.listdir(folder)))
    return found


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "ok")
