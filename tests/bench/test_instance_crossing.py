"""bench/instance_crossing.py: both crossings run the real model on real processes and answer the array
sent; the figures are per batch and the ratios are the medians' own."""

import pytest

from bench import instance_crossing


def test_both_crossings_answer_what_was_sent_and_the_figures_are_per_batch(capsys):
    result = instance_crossing.main(["--blocks", "1", "--batches", "20"])
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith('{"bench": "instance_crossing"')
    for side in ("azulite", "floor"):
        figures = result["median"][side]
        # every batch spins until 1 ms of the clock has passed in its instance: none answers sooner (a
        # crossing that skipped the model would)
        assert figures["wall_p50_us"] >= 1000
        assert figures["instance_cpu_us"] > 0 and figures["loop_cpu_us"] > 0
    for k, ratio in result["azulite_over_floor"].items():
        assert ratio == round(result["median"]["azulite"][k] / result["median"]["floor"][k], 3)


@pytest.mark.parametrize("argv", [["--blocks", "0"], ["--batches", "0"]])
def test_no_block_or_batch_is_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        instance_crossing.main(argv)
    assert exc.value.code == 2 and "at least 1" in capsys.readouterr().err
