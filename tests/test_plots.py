"""The run directory's plots: labelled axes, the warm-start loss, a mismatch plot that shows 0."""

import matplotlib

matplotlib.use("Agg")

from matplotlib.figure import Figure  # noqa: E402

from jaxrl_lp.train.logger import plot_metrics, plot_specs  # noqa: E402

RECORDS = (
    [{"step": s, "phase": "sft", "loss": 2.0 / s, "skipped": 0.0} for s in range(1, 4)]
    + [{"step": 3, "phase": "eval", "accuracy": 0.25}]
    + [{"step": s, "phase": "grpo", "reward_mean": 0.1 * s, "mismatch_k3": 0.0,
        "mismatch_max_abs_dlogp": 0.0 if s == 4 else 1e-3, "timing_s/sample": 0.5,
        "timing_s/update": 0.25 * s} for s in range(4, 7)]
    + [{"step": 6, "phase": "eval", "accuracy": 0.5}]
)


def test_specs_have_labels_the_warm_start_loss_and_say_what_zero_mismatch_means():
    specs = {s.name: s for s in plot_specs(RECORDS)}
    assert set(specs) == {"sft_loss.png", "reward.png", "accuracy.png", "mismatch.png",
                          "timing.png"}
    for spec in specs.values():
        assert spec.title and spec.ylabel, spec.name
    assert specs["sft_loss.png"].series["loss"] == ([1, 2, 3], [2.0, 1.0, 2.0 / 3])
    assert specs["accuracy.png"].series["accuracy"] == ([3, 6], [0.25, 0.5])
    mismatch = specs["mismatch.png"]
    assert "0 = exact" in mismatch.title and "0 = " in mismatch.ylabel
    assert mismatch.yscale == "symlog"  # linear near 0: exact agreement is drawn at 0
    assert mismatch.series["mismatch_k3"][1] == [0.0, 0.0, 0.0]
    timing = specs["timing.png"]  # the phases a record has; none drawn for those it lacks
    assert set(timing.series) == {"timing_s/sample", "timing_s/update"}
    assert timing.series["timing_s/update"] == ([4, 5, 6], [1.0, 1.25, 1.5])


def test_plot_metrics_writes_every_png_with_labelled_axes(tmp_path, monkeypatch):
    drawn = {}
    save = Figure.savefig

    def savefig(fig, path, *args, **kwargs):
        ax = fig.axes[0]
        drawn[path.name] = (ax.get_xlabel(), ax.get_ylabel(), ax.get_yscale())
        return save(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    written = plot_metrics(RECORDS, tmp_path)
    assert sorted(p.name for p in written) == sorted(drawn)
    assert all(p.stat().st_size > 0 for p in written)
    for name, (xlabel, ylabel, _) in drawn.items():
        assert xlabel == "step" and ylabel, name
    assert drawn["mismatch.png"][2] == "symlog"
