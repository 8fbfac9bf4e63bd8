"""Integrity at the edges (issue 26): values that passed validation and crashed the run later, folders a run
must not write into, the launcher's checks before it starts anything, run folders, bad data files."""

from pathlib import Path

import pytest

from fl_app.config import ConfigError, validate

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- config values that crashed the run later

@pytest.mark.parametrize("key,value,message", [
    ("audit-canaries", 10**7, "run-config key 'audit-canaries' = 10000000: must be an integer in [0, 10000] "
                              "(each canary is a model-sized vector in the server's memory)"),
    ("mu-max", 1e-300, "run-config key 'mu-max' = 1e-300: must be a number in [1e-06, 1e+06] "
                       "(the clients' mu ratios are divided by it)"),
    ("sample-rate", 1e-300, "run-config key 'sample-rate' = 1e-300: must be a number in [1e-06, 1]"),
])
def test_values_that_crashed_later_are_refused_at_validation(key, value, message):
    with pytest.raises(ConfigError) as err:
        validate({key: value})
    assert str(err.value) == message


def test_the_bounds_themselves_are_allowed():
    cfg = validate({"audit-canaries": 10_000, "sample-rate": 1e-6})
    assert (cfg["audit-canaries"], cfg["sample-rate"]) == (10_000, 1e-6)
    assert validate({"algorithm": "ali-dpfl", "target-epsilon": 2.0, "mu-max": 1e-6})["mu-max"] == 1e-6


@pytest.mark.parametrize("path,where", [
    ("/", "'/' is the filesystem root"),
    ("/etc", "'/etc' is in the system tree /etc"),
    ("/usr/local/dpfl-results", "'/usr/local/dpfl-results' is in the system tree /usr"),
    ("/proc/self", "in the system tree /proc"),
])
def test_results_dir_in_a_system_folder_is_refused(path, where):
    with pytest.raises(ConfigError) as err:
        validate({"results-dir": path})
    msg = str(err.value)
    assert msg.startswith(f"run-config key 'results-dir' = {path!r}: must be a folder outside the filesystem root "
                          "and /bin, /boot, /dev, /etc,") and msg.endswith(where), msg


def test_results_dir_holding_other_files_is_refused_but_a_run_folder_or_empty_one_is_not(tmp_path):
    (tmp_path / "thesis.tex").write_text("mine")
    (tmp_path / "data").mkdir()
    with pytest.raises(ConfigError) as err:
        validate({"results-dir": str(tmp_path)})
    assert str(err.value) == (
        f"run-config key 'results-dir' = {str(tmp_path)!r}: must be a new or empty folder, or a dpfl run folder "
        "(one holding config.json or status.json or metrics.jsonl or checkpoint.npz or .dpfl-run.lock); "
        "it holds 2 other entries ('data', 'thesis.tex')")
    assert validate({"results-dir": str(tmp_path / "data")})["results-dir"] == str(tmp_path / "data")  # empty
    assert validate({"results-dir": str(tmp_path / "new" / "run")})  # not there yet
    (tmp_path / "status.json").write_text('{"status": "failed"}')  # a run folder: resumed or refused by the run
    assert validate({"results-dir": str(tmp_path)})


def test_a_misspelled_key_names_its_close_matches():
    with pytest.raises(ConfigError) as err:
        validate({"nosie-multiplier": 2.0, "sample_rate": 0.1})
    assert str(err.value).startswith("unknown run-config key(s) 'nosie-multiplier' = 2.0 (did you mean "
                                     "'noise-multiplier' or 'mu-noise-multiplier' or 'sample-noise-multiplier'?), "
                                     "'sample_rate' = 0.1 (did you mean 'sample-rate'"), str(err.value)
