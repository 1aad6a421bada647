from dapple_ir.cli import main


def test_version(capsys):
    try:
        main(["--version"])
    except SystemExit as exc:
        assert exc.code == 0
    assert "dapple-ir" in capsys.readouterr().out
