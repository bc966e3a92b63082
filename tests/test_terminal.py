"""What the command line prints is safe for a terminal (probe F8: a model_type holding escape sequences reached
the terminal raw through `memory`'s error, and a path holding them through a command's summary). Files keep
what was given: only what is printed is escaped."""

from __future__ import annotations

import json

import pytest

from invink_audit.cli import EXIT_BAD_INPUT, main
from invink_audit.terminal import printable

# ESC sequences (set the window title, clear the screen), BEL, DEL, a C1 CSI, a bidi override, a newline
HOSTILE = "\x1b]0;PWNED\x07\x1b[2J\x7f\x9b\u202e\n"


def test_printable_escapes_every_character_a_terminal_interprets():
    assert printable("café × naïve …") == "café × naïve …"
    assert printable(HOSTILE) == "\\x1b]0;PWNED\\x07\\x1b[2J\\x7f\\x9b\\u202e\\n"
    assert printable("a\tb\rc\x00") == "a\\tb\\rc\\x00"
    assert printable(3) == "3" and printable("") == ""
    assert printable("\x07" * 100, limit=8) == "\\x07\\x07... (100 characters)"


def _clean(text: str) -> None:
    assert not any(c in text for c in "\x1b\x07\x7f\x9b\u202e"), ascii(text)


def test_an_error_quoting_a_config_is_escaped(tiny_dir, tmp_path, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    config = json.loads((tiny_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llama" + HOSTILE}))
    rc = main(["memory", "--model", str(folder), "--batch-size", "2", "--max-new-tokens", "8", "--prompt-tokens", "16"])
    err = capsys.readouterr().err
    assert rc == EXIT_BAD_INPUT and err.count("\n") == 1, err
    _clean(err)
    assert "llama\\x1b]0;PWNED\\x07\\x1b[2J" in err


def test_a_usage_error_quoting_an_argument_is_escaped(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["ledger", "show", "ledger.json", "stray" + HOSTILE])
    err = capsys.readouterr().err
    assert stop.value.code == EXIT_BAD_INPUT and err.count("\n") == 1 and "unrecognized arguments: stray\\x1b" in err
    _clean(err)


def test_a_path_in_a_summary_is_escaped_and_the_file_keeps_its_name(tmp_path, capsys):
    path = tmp_path / ("ledger\x1b[2J\u202e.json")
    assert main(["ledger", "init", str(path), "--epsilon", "1", "--delta", "1e-6"]) == 0
    assert main(["ledger", "show", str(path)]) == 0
    out = capsys.readouterr().out
    _clean(out)
    assert out.count("ledger\\x1b[2J\\u202e.json") == 3 and path.is_file()


def test_generate_prints_its_output_path_escaped(tmp_path, capsys):
    """The summary names the output as given, with escape sequences shown, not sent to the terminal."""
    from invink_audit.cli import main
    from invink_audit.models import build_tiny_model

    tiny = build_tiny_model(seed=5)
    model = tmp_path / "tiny"
    tiny.model.save_pretrained(model)
    tiny.tokenizer.save_pretrained(model)
    references = tmp_path / "refs.csv"
    references.write_text("text\nThe soup was cold.\nGreat tacos!\n", encoding="utf-8")
    folder = tmp_path / "out\x1b[2J"
    code = main(["generate", "--input", str(references), "--output", str(folder / "x.jsonl"), "--model", str(model),
                 "--batch-size", "2", "--max-new-tokens", "3", "--epsilon", "5", "--delta", "1e-6", "--top-k", "8",
                 "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0 and "\x1b" not in out and "\\x1b[2J" in out
    assert (folder / "x.jsonl").is_file()  # the file keeps the name as given
