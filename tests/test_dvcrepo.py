import json
import os
import subprocess
import sys
import time

import psutil

from posttrain.dvcrepo import clear_stale_locks


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid  # reaped: no such process any more


def test_clear_stale_locks_keeps_live_holders(tmp_path):
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # exits, but is not reaped: a zombie
    for _ in range(100):
        if psutil.Process(zombie.pid).status() == psutil.STATUS_ZOMBIE:
            break
        time.sleep(0.05)
    dead, live = _dead_pid(), os.getpid()
    lock = tmp_path / ".dvc" / "tmp" / "rwlock"
    lock.parent.mkdir(parents=True)
    lock.write_text(json.dumps({
        "write": {"/r/models/sft": {"pid": dead, "cmd": "dvc repro"}, "/r/models/x": {"pid": live, "cmd": "dvc"}},
        "read": {"/r/a.py": [{"pid": dead, "cmd": "dvc"}, {"pid": live, "cmd": "dvc"}],
                 "/r/b.py": [{"pid": zombie.pid, "cmd": "dvc"}]},
    }))
    assert clear_stale_locks(tmp_path) == ["/r/a.py", "/r/b.py", "/r/models/sft"]
    zombie.wait()
    left = json.loads(lock.read_text())
    assert left == {"write": {"/r/models/x": {"pid": live, "cmd": "dvc"}},
                    "read": {"/r/a.py": [{"pid": live, "cmd": "dvc"}]}}
    assert clear_stale_locks(tmp_path) == []  # nothing stale left
    assert clear_stale_locks(tmp_path / "nope") == []
