"""Who holds the others back: train.stragglers judging every rank's seconds per phase."""


def test_a_straggler_is_slow_only_when_it_costs_the_others():
    """Busy (data, forward, optimizer) 10% over the median for 3 intervals, by 5% of the wall time or more."""
    from ddp_amp.train.stragglers import StragglerWatch

    def interval(watch, forward_s, backward_s):  # phases: data, forward, backward, step, log
        return watch.unpack([x for f, b in zip(forward_s, backward_s) for x in (0.001, f, b, 0.001, 0.001)])

    watch = StragglerWatch(rank=0, world_size=3)
    for _ in range(2):
        interval(watch, [0.010, 0.010, 0.030], [0.030, 0.030, 0.010])
    assert watch.slow == []  # not yet a window of 3
    interval(watch, [0.010, 0.010, 0.030], [0.030, 0.030, 0.010])
    assert watch.slow == [2]
    quiet = StragglerWatch(rank=0, world_size=2)
    for _ in range(3):  # 20% more busy time, but 0.4 ms of a 42 ms interval
        interval(quiet, [0.002, 0.0024], [0.04, 0.04])
    assert quiet.slow == []
    assert watch.summary()["slow_ranks"] == [2] and watch.summary()["time_per_rank_s"]["2"]["forward"] == 0.09
