"""`python -m fp8_engram.quant.selftest`'s arguments and output: a device it cannot run on, a token count
that is not a positive whole number in range, or a stdout that cannot take the report ends in one line on
stderr and a non-zero exit status (2 for a bad argument), never a traceback."""

import os
import subprocess
import sys
import textwrap

import pytest

from fp8_engram.quant import selftest

pytestmark = pytest.mark.unit

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ".host", "pkg")


@pytest.fixture
def no_run(monkeypatch):
    def run(device, models, tokens, cache=None):
        raise AssertionError(f"the selftest ran with device {device}, tokens {tokens}")

    monkeypatch.setattr(selftest, "run", run)


@pytest.mark.parametrize("argv, names", [
    (["--device", "meta"], "--device"),
    (["--device", "mps"], "--device"),
    (["--device", "xpu:0"], "--device"),
    (["--device", "not-a-device"], "--device"),
    (["--device", "cpu", "--tokens", "-5"], "--tokens"),
    (["--device", "cpu", "--tokens", "1e8"], "--tokens"),
    (["--device", "cpu", "--tokens", "100000000"], "--tokens"),
    (["--device", "cpu", "--tokens", "16,0"], "--tokens"),
    (["--device", "cpu", "--models", "sd3,sdxl"], "--models"),
])
def test_a_bad_argument_is_one_line_and_exit_status_2(no_run, capsys, argv, names):
    with pytest.raises(SystemExit) as info:
        selftest.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert names in err and "error" in err, err


def test_a_cuda_device_this_machine_lacks_is_refused(no_run, capsys):
    import torch

    index = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(SystemExit) as info:
        selftest.main(["--device", f"cuda:{index}"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "CUDA GPU(s) here" in err and len(err.strip().splitlines()) == 1, err


def test_good_arguments_reach_the_run(monkeypatch, capsys):
    seen = {}

    def run(device, models, tokens, cache=None):
        seen.update(device=str(device), models=models, tokens=tokens)
        return {"stack": {"device": "cpu"}, "seconds": 0.0, "verdicts": []}

    monkeypatch.setattr(selftest, "run", run)
    assert selftest.main(["--device", "cpu", "--tokens", "16, 256", "--models", "sd3,flux", "--json"]) == 0
    assert seen == {"device": "cpu", "models": ["sd3", "flux"], "tokens": (16, 256)}
    assert '"verdicts": []' in capsys.readouterr().out


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux) to make stdout fail")
@pytest.mark.parametrize("form", ["--json", "--table"])
def test_a_stdout_that_cannot_take_the_report_is_one_line_and_a_failure(form):
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {PKG!r})
        from fp8_engram.quant import selftest
        selftest.run = lambda device, models, tokens, cache=None: {{"stack": {{"device": "cpu"}}, "seconds": 0.0, "verdicts": []}}
        sys.exit(selftest.main(["--device", "cpu"] + ({form!r} == "--json") * ["--json"]))
        """)
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-c", script], stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode != 0, done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "cannot write the report to stdout" in done.stderr, done.stderr
