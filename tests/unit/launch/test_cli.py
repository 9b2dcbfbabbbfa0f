"""launch/cli.py in process (its ``main``): bad paths exit 2 with a message before anything runs. The exit status of
the command itself is tests/e2e/test_lifecycle.py's."""
import time


def bad_cases(tmp):
    (tmp / "file").write_text("x")
    (tmp / "adir").mkdir()
    proj = tmp / "project"
    (proj / "checkpoint").mkdir(parents=True)
    (proj / "checkpoint" / "model.pt").write_text("precious")
    (proj / "config.json").write_text('{"lr": 1}')
    ok = str(tmp / "new-run")
    return [
        (["--run-dir", str(tmp / "file")], "exists and is not a directory"),
        (["--run-dir", str(tmp / "file" / "sub")], "is not a directory, so"),
        (["--run-dir", ""], "--run-dir '': empty"),
        (["--run-dir", "/proc"], "cannot create files in /proc"),
        (["--run-dir", str(proj)], "holds other files and no deadpool run"),
        (["--run-dir", ok, "--summary", str(tmp / "adir")], "is a directory; accepted: a file path"),
        (["--run-dir", ok, "--summary", str(tmp / "file" / "s.json")], f"its directory {tmp / 'file'} is not a directory"),
        (["--run-dir", ok, "--summary", str(tmp / "nowhere" / "s.json")], "does not exist"),
        (["--run-dir", ok, "--summary", "/proc/s.json"], "cannot create files in /proc"),
        (["--run-dir", ok, "--seed", "-1"], "--train-arg seed=-1: accepted"),
    ]


def test_bad_paths_exit_2_with_a_message_before_anything_runs(tmp_path, capsys):
    """In process (the CLI's own ``main``): checking paths starts nothing. The exit status of the command itself is
    test_second_run_in_the_same_run_dir_is_refused_and_the_first_is_untouched's."""
    from deadpool_hpc.launch.cli import main

    for args, msg in bad_cases(tmp_path):
        t0 = time.monotonic()
        try:
            code = main(["run", "--nodes", "2", "--spares", "1", "--steps", "10", *args])
        except SystemExit as exc:
            code = exc.code
        took = time.monotonic() - t0
        err = capsys.readouterr().err
        assert code == 2 and msg in err and "Traceback" not in err, (args, err[-2000:])
        assert took < 30, (args, took)
    assert not (tmp_path / "new-run").exists(), "a refused run created its run directory"
    assert (tmp_path / "project" / "checkpoint" / "model.pt").read_text() == "precious"
