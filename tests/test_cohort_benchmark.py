"""benchmarks.cohort's ray engine data: the synthetic parquet export is read by the product's own reader."""

import numpy as np
import pytest

from benchmarks.cohort import main, write_parquet_export
from dpfl.dpcore.task.data_files import read_local


@pytest.mark.parametrize(("dataset", "shape"), [("mnist", (28, 28)), ("cifar10", (32, 32, 3))])
def test_parquet_export_reads_back_with_the_dataset_shape(tmp_path, dataset, shape):
    write_parquet_export(tmp_path, dataset, train=50, test=7)
    raw = read_local(dataset, tmp_path)
    assert raw.x_train.shape == (50, *shape) and raw.x_test.shape == (7, *shape)
    assert raw.x_train.dtype == np.uint8 and 0 <= raw.y_train.min() and raw.y_train.max() <= 9
    assert raw.x_train.std() > 50  # uniform noise over 0..255 (std 73.9), not a constant image


def test_unknown_engine_is_refused_with_the_allowed_ones(capsys):
    with pytest.raises(SystemExit):
        main(["--engines", "cohort,rays"])
    assert "unknown ['rays']; allowed: inprocess, cohort, ray" in capsys.readouterr().err


def test_bad_processes_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--processes", "1,0"])
    assert "--processes '1,0': allowed are integers of at least 1" in capsys.readouterr().err


@pytest.mark.slow
def test_cohort_in_two_processes_trains_on_the_stand_in_data(monkeypatch):
    """The workers load the benchmark's synthetic CIFAR-10-shaped data (its initializer): no CIFAR-10 is offline
    here, so a worker that loaded the real dataset would fail its replies, which `one` raises."""
    import dpfl.fl_app.client_app as project
    from benchmarks.cohort import one

    # `one` swaps the ClientApp's loader in this process too (as in its own): put the real one back afterwards
    monkeypatch.setattr(project, "load_client_partition", project.load_client_partition)
    row = one("cnn-cifar10", 3, "cohort", "cpu", 1, 8, processes=2)
    assert row["processes"] == 2 and row["seconds"] > 0 and row["cuda_max_allocated_mib"] is None
    assert row["peak_rss_mib"] > 3 * 100  # the sum of three processes, each with torch loaded


@pytest.mark.slow
def test_cohort_run_times_whole_rounds_through_the_launcher():
    """`--engines cohort-run`: the launcher's cohort engine on the synthetic parquet export, every node in every
    round, the seconds of round rounds - 1 read from its run folder (as Ray's are)."""
    from benchmarks.cohort import launched_round

    row = launched_round("cohort-run", "cnn-mnist", 4, "cpu", 1, 8, 3, None, 300, processes=2)
    assert row["engine"] == "cohort-run" and row["processes"] == 2
    assert row["trained"] == [4, 4, 4] and len(row["round_seconds"]) == 3
    assert row["seconds"] == row["round_seconds"][1] > 0
