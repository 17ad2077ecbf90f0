"""scripts/bench runs end to end and reports every figure the design asks for (behaviour, never speed)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"

RTT_RAW = ("inproc", "ipc", "tcp")
RTT_BUS = ("inproc", "ipc", "tcp", "tcp_curve")
TPUT = ("ipc", "tcp")


def _positive(report: dict[str, Any], *path: str) -> None:
    value: Any = report
    for key in path:
        assert isinstance(value, dict) and key in value, f"report lacks {'.'.join(path)}"
        value = value[key]
    assert isinstance(value, int | float) and not isinstance(value, bool), f"{'.'.join(path)} = {value!r}"
    assert value > 0, f"{'.'.join(path)} = {value!r}"


@pytest.mark.integration
@pytest.mark.timeout(270)
def test_quick_bench_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    # Run as a user would (shebang, re-exec into .venv), from a folder that is not the repository.
    proc = subprocess.run(
        [str(BENCH), "--quick", "--turns", "40", "--json", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,  # a bound for a hang, not a speed check: a loaded machine takes twice the quiet 60 s
        check=False,
    )
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(out.read_text())

    for t in RTT_RAW:
        _positive(report, "rtt_us", "raw", t)
        _positive(report, "rtt_ratio", t)
    for t in RTT_BUS:
        _positive(report, "rtt_us", "bus", t)
    for t in TPUT:
        _positive(report, "throughput", "raw", t)
        _positive(report, "throughput", "bus", t)
        _positive(report, "throughput", "direct", t)  # the sink on a socket of its own
        _positive(report, "throughput_ratio", t)
        _positive(report, "throughput_ratio_direct", t)
        delivery = report["bus_delivery"][t]
        assert delivery["delivered"] + delivery["dropped"] == delivery["sent"], delivery
    _positive(report, "session", "us_per_round")
    _positive(report, "session", "us_per_tool_round")  # the host ran every call (the bench checks)
    for clients in ("clients_1", "clients_32"):  # turns against a Router with a data dir, its commits counted
        _positive(report, "router_durable", clients, "turns_per_s")
        assert 0 < report["router_durable"][clients]["commits_per_turn"] <= 2, report["router_durable"]
    for key in ("cpu_count", "python", "pyzmq", "libzmq"):
        assert report["machine"][key], f"machine.{key} missing"
    assert "Round-trip time" in proc.stdout and "One-way throughput" in proc.stdout


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_only_picks_one_section(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [str(BENCH), "--quick", "--only", "rtt", "--json", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(out.read_text())
    assert "rtt_us" in report
    assert "throughput" not in report
