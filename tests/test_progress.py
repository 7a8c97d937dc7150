"""Progress bars: warm-start and GRPO are separate phases with their own counts, rates and ETAs."""

from jaxrl_lp.train.progress import PhaseProgress


class FakeBar:
    """Records what a tqdm bar would be told."""

    def __init__(self, log, **kwargs):
        self.log, self.kwargs, self.n, self.closed = log, kwargs, kwargs["initial"], False
        log.append(("open", kwargs["desc"], kwargs["initial"], kwargs["total"]))

    def update(self, k):
        self.n += k

    def set_postfix(self, postfix):
        self.postfix = postfix

    def close(self):
        self.closed = True
        self.log.append(("close", self.kwargs["desc"], self.n))


def _bars(phases, step, log, **kw):
    return PhaseProgress(phases, step, make_bar=lambda **k: FakeBar(log, **k), **kw)


def test_one_bar_per_phase_each_closed_when_its_phase_ends():
    log = []
    bars = _bars([("warm-start", 3), ("grpo", 2)], 0, log)
    for step in range(1, 6):
        bars.update(step, {"loss": 1.0})
    bars.close()
    assert log == [("open", "warm-start", 0, 3), ("close", "warm-start", 3),
                   ("open", "grpo", 0, 2), ("close", "grpo", 2)]


def test_a_resumed_run_opens_the_phase_it_resumes_in_with_the_steps_done():
    log = []
    bars = _bars([("warm-start", 3), ("grpo", 4)], 4, log)  # resumed after GRPO step 1
    bars.update(5)
    bars.close()  # interrupted (stop_after)
    assert log == [("open", "grpo", 1, 4), ("close", "grpo", 2)]
    log.clear()
    bars = _bars([("warm-start", 3), ("grpo", 4)], 1, log)
    assert log == [("open", "warm-start", 1, 3)]


def test_empty_phases_are_skipped_and_disabled_bars_do_nothing():
    log = []
    bars = _bars([("warm-start", 0), ("grpo", 2)], 0, log)
    bars.update(1)
    bars.update(2)
    assert log == [("open", "grpo", 0, 2), ("close", "grpo", 2)]
    log.clear()
    bars = _bars([("warm-start", 2), ("grpo", 2)], 0, log, enabled=False)
    bars.update(1)
    bars.close()
    assert log == []
