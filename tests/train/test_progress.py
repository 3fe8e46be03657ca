import io

from mlscale.train.progress import Progress


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_live_bar_with_loss_and_speed():
    stream = FakeTerminal()
    progress = Progress(total=100, stream=stream)
    progress.update(50, loss=0.5, samples_per_s=1234.0)
    progress.close()
    text = stream.getvalue()
    assert "\r" in text and "50/100" in text and "loss=0.5000" in text and "samples_s=1,234" in text


def test_a_log_gets_about_ten_plain_lines():
    stream = io.StringIO()
    progress = Progress(total=100, stream=stream)
    for step in range(1, 101):
        progress.update(step, loss=1.0, samples_per_s=10.0)
    lines = stream.getvalue().splitlines()
    assert 9 <= len(lines) <= 11 and lines[-1].startswith("step 100/100") and "ETA" in lines[-1]
