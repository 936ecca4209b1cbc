"""Progress on stderr while a benchmark runs: rich's live bars on a terminal, plain lines otherwise."""

from __future__ import annotations


class PlainProgress:
    """The slice of rich's Progress that the benchmarks use, as a plain stderr line at every 10%."""

    def __init__(self, console) -> None:
        self.console = console
        self.tasks: dict[int, list] = {}

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def add_task(self, description: str, total: int) -> int:
        self.tasks[len(self.tasks)] = [description, total, 0]
        return len(self.tasks) - 1

    def advance(self, task: int, n: int = 1) -> None:
        description, total, done = self.tasks[task]
        self.tasks[task][2] = done + n
        if (done + n) * 10 // total > done * 10 // total:
            self.console.print(f"{description}: {done + n}/{total}")


def progress_display(*, live: bool = True):
    """A Progress-like context manager on stderr: rich's bars when `live` and stderr is a terminal
    (not CI, not a log file, where rich draws nothing live), else `PlainProgress`."""
    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True)
    return Progress(console=console) if live and console.is_terminal else PlainProgress(console)
