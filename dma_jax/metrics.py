"""Accuracy metrics (docs/design.md, "Accuracy metrics"), computed in float64 with numpy."""

from __future__ import annotations

import numpy as np

__all__ = ["METRICS", "error_metrics"]

METRICS = ("cosine", "rel_l1", "rmse", "max_abs")


def error_metrics(out, ref) -> dict[str, float]:
    """Cosine similarity, relative L1, RMSE and max-abs error of ``out`` vs ``ref``."""
    o = np.asarray(out, dtype=np.float64).ravel()
    r = np.asarray(ref, dtype=np.float64).ravel()
    if o.shape != r.shape:
        raise ValueError(f"shapes differ: {np.shape(out)} vs {np.shape(ref)}")
    diff = o - r
    denom = np.linalg.norm(o) * np.linalg.norm(r)
    return {
        "cosine": float(o @ r / denom) if denom > 0 else float("nan"),
        "rel_l1": float(np.abs(diff).sum() / np.abs(r).sum()),
        "rmse": float(np.sqrt(np.mean(diff**2))),
        "max_abs": float(np.abs(diff).max()),
    }
