"""The status line: redrawn in place on a terminal, at most one line per interval in a log."""

import io

from qat4.commands.progress import ProgressLine


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_the_held_back_last_line_once():
    log = io.StringIO()
    line = ProgressLine(log, interval_s=3600)
    line.update("1/3")
    line.update("2/3")
    line.update("3/3")
    line.done()
    assert log.getvalue() == "1/3\n3/3\n"


def test_a_log_line_already_shown_is_not_repeated():
    log = io.StringIO()
    line = ProgressLine(log, interval_s=0)
    line.update("1/2")
    line.update("2/2")
    line.done()
    assert log.getvalue() == "1/2\n2/2\n"


def test_a_terminal_line_is_redrawn_and_ended():
    term = Terminal()
    line = ProgressLine(term)
    line.update("long text")
    line.update("short")
    line.done()
    assert term.getvalue() == "\rlong text\rshort    \n"
