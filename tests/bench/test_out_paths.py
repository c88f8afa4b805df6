"""Every benchmark checks its --out/--out-dir before it runs (``workbench.outputs``): a bad
path is a usage error (exit 2, the option named), never results lost after minutes of work."""

import pytest

from workbench import outputs
from workbench.bench.__main__ import BENCHMARKS, main

FILE_BENCHMARKS = sorted(set(BENCHMARKS) - {"all"})


def refused(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err


@pytest.mark.parametrize("name", FILE_BENCHMARKS)
def test_a_folder_or_a_path_under_a_file_is_refused_before_the_run(name, tmp_path, capsys,
                                                                   monkeypatch):
    refused(capsys, [name, "--out", str(tmp_path)], "is a folder; give a file name")
    blocker = tmp_path / "results.csv"
    blocker.write_text("")
    refused(capsys, [name, "--out", str(blocker / "x.csv")], "is a file, so no folder")


def test_all_refuses_a_file_as_out_dir(tmp_path, capsys):
    blocker = tmp_path / "results"
    blocker.write_text("")
    refused(capsys, ["all", "--out-dir", str(blocker)], "is a file; give a folder")


def test_unwritable_folders_are_refused(tmp_path, monkeypatch):
    def no_write(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(outputs.tempfile, "NamedTemporaryFile", no_write)
    for check in (outputs.check_output_file, outputs.check_output_dir):
        with pytest.raises(outputs.OutputPathError, match="is not writable.*Permission denied"):
            check(tmp_path / "new" / "out.csv", "--out")


def test_good_paths_are_created_and_returned(tmp_path):
    assert outputs.check_output_file(tmp_path / "a" / "b.csv") == tmp_path / "a" / "b.csv"
    assert (tmp_path / "a").is_dir() and not (tmp_path / "a" / "b.csv").exists()
    assert outputs.check_output_dir(tmp_path / "c") == tmp_path / "c"
    assert list((tmp_path / "c").iterdir()) == []  # the probe file is gone
