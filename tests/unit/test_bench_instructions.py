"""bench.instructions reads the right line of a callgrind dump and runs the proxy without its clock work."""

from __future__ import annotations

from pathlib import Path

from bench.floor import setting_env
from bench.instructions import SLOW_SETTINGS, dumped_instructions
from proxy.config import load_config

# A dump as callgrind 3.19 writes it after `callgrind_control --zero/--instr=on/--instr=off/--dump`: its summary
# counts from the start of the run with collection off (0); its totals are the window's instructions.
DUMP = """# callgrind format
version: 1
creator: callgrind-3.19.0
pid: 4242
cmd:  /venv/bin/python -m proxy.cli run
part: {part}

desc: I1 cache:
positions: line
events: Ir
summary: 0

fn=(1) main
0 {total}

totals: {total}
"""


def test_the_newest_dump_s_totals_are_read_not_its_summary(tmp_path: Path) -> None:
    for part, total in ((1, 5), (2, 123456789), (10, 987654321)):  # 10 sorts after 2 as a number
        (tmp_path / f"callgrind.4242.{part}").write_text(DUMP.format(part=part, total=total))
    (tmp_path / "callgrind.4242").write_text(DUMP.format(part=0, total=1))  # the final dump at exit
    assert dumped_instructions(tmp_path, 4242) == 987654321


def test_the_slow_settings_are_valid_and_turn_the_clock_work_off(monkeypatch) -> None:
    for name, value in setting_env(SLOW_SETTINGS).items():
        monkeypatch.setenv(name, value)
    config = load_config()
    assert config.registry.reload_interval_ms == 0
    assert config.reconcile.scan_interval_ms >= 3_600_000
    assert config.mcp_pins.read_max_age_ms >= 3_600_000 and config.mcp_pins.check_interval_ms >= 3_600_000
    assert config.opa.timeout_ms >= 10_000 and config.redis.timeout_ms >= 10_000
